"""The [yield] rules applied to what a look saw (stepaside/policy.py): which program the daemon
steps aside for, and when that ends. Pure: hand-built programs and sightings, and a clock that
is just a number."""

from __future__ import annotations

from dataclasses import replace

from arbiterd.config import YIELD_PROGRAMS, YieldRules
from arbiterd.daemon.stepaside.policy import (
    ASKED,
    Aside,
    Sighting,
    asked,
    matches,
    next_aside,
    trigger,
)
from arbiterd.daemon.stepaside.programs import Program

GIB = 1 << 30
# Small numbers that read easily: a program at or over 1000 bytes is stepped aside for.
RULES = YieldRules(programs=("blender", "*comfyui*"), ignore=("xorg",), min_bytes=1000, grace_s=10)


def program(
    pid: int, name: str, *cmdline: str, start: int | None = None, parent: int = 1
) -> Program:
    """A process as the scan would give it; `start` defaults to a tick count unique to `pid`."""
    return Program(pid, pid * 100 if start is None else start, name, cmdline, parent)


def look(
    current: Aside | None,
    *sightings: Sighting,
    rules: YieldRules = RULES,
    now: float = 0.0,
    own: tuple[int, ...] = (),
    passed: tuple[tuple[int, int], ...] = (),
) -> Aside | None:
    return next_aside(current, sightings, rules, own=own, passed=passed, now=now)


GAME = program(10, "game")  # in no rule's names: stepped aside for only by its memory
BLENDER = program(20, "blender", "/opt/blender/blender", "scene.blend")


# -- matches ---------------------------------------------------------------------------------


def test_comfyui_run_as_python_is_caught_by_its_command_line() -> None:
    comfy = program(1, "python", "python", "/home/u/ComfyUI/main.py", "--listen")
    assert matches(comfy, YIELD_PROGRAMS) == "*comfyui*"


def test_a_steam_game_is_caught_by_the_library_path_in_its_command_line() -> None:
    game = program(
        1, "portal2_linux", "/home/u/.steam/steam/steamapps/common/Portal 2/portal2_linux"
    )
    assert matches(game, YIELD_PROGRAMS) == "*/steamapps/common/*"


def test_a_program_is_matched_by_its_argv0_base_name_when_its_name_differs() -> None:
    # The main thread renamed itself (prctl): only argv[0]'s base name says "blender".
    renamed = program(1, "GameThread", "/opt/blender/blender", "scene.blend")
    assert matches(renamed, ["blender"]) == "blender"
    assert matches(program(1, "GameThread", "/opt/other/run"), ["blender"]) is None


def test_names_match_without_case_and_the_pattern_is_given_back_as_written() -> None:
    assert matches(program(1, "Blender"), ["BLENDER"]) == "BLENDER"
    assert matches(program(1, "python", "python", "/srv/comfyui/main.py"), ["*ComfyUI*"]) == (
        "*ComfyUI*"
    )


def test_a_pattern_without_a_wildcard_names_the_whole_name_not_a_part() -> None:
    assert matches(program(1, "blender-helper", "blender-helper"), ["blender"]) is None


def test_the_first_pattern_that_names_the_program_is_the_one_given() -> None:
    comfy = program(1, "python", "python", "/home/u/ComfyUI/main.py")
    assert matches(comfy, ["blender", "*comfyui*", "python"]) == "*comfyui*"
    assert matches(comfy, ["blender"]) is None
    assert matches(comfy, []) is None


def test_a_program_without_a_command_line_is_matched_by_its_name() -> None:
    assert matches(program(1, "blender"), ["blender"]) == "blender"


# -- trigger ---------------------------------------------------------------------------------


def test_a_named_program_triggers_by_name_whatever_its_memory() -> None:
    for used in (None, 0, 5 * GIB):
        assert trigger(Sighting(BLENDER, used), RULES) == (
            "named in [yield] programs ('blender')",
            False,
        )


def test_memory_at_min_bytes_triggers_and_just_under_it_does_not() -> None:
    why = trigger(Sighting(GAME, 1000), RULES)
    assert why is not None
    reason, by_memory = why
    assert by_memory
    assert "holds 1000 B of device memory" in reason
    assert "min_bytes is 1000 B" in reason
    assert trigger(Sighting(GAME, 999), RULES) is None


def test_the_reason_gives_the_memory_and_the_default_min_bytes_in_binary_units() -> None:
    why = trigger(Sighting(GAME, 2 * GIB), YieldRules())
    assert why == ("holds 2.0 GiB of device memory ([yield] min_bytes is 512.0 MiB)", True)


def test_unmeasured_memory_never_triggers() -> None:
    assert trigger(Sighting(GAME, None), RULES) is None


def test_min_bytes_zero_turns_the_memory_rule_off() -> None:
    off = YieldRules(programs=(), min_bytes=0)
    assert trigger(Sighting(GAME, 5 * GIB), off) is None
    assert trigger(Sighting(GAME, 0), off) is None
    assert trigger(Sighting(BLENDER, 0), YieldRules(min_bytes=0)) is not None


def test_ignore_stops_the_memory_rule_but_not_a_name_the_user_listed() -> None:
    xorg = program(1, "Xorg", "/usr/lib/xorg/Xorg", ":0")
    assert trigger(Sighting(xorg, 5 * GIB), RULES) is None  # "xorg" is ignored, without case
    assert trigger(Sighting(xorg, 5 * GIB), YieldRules()) is None  # and by default
    both = YieldRules(programs=("*firefox*",), ignore=("*firefox*",), min_bytes=1000)
    firefox = program(2, "firefox", "/usr/lib/firefox/firefox")
    assert trigger(Sighting(firefox, 5 * GIB), both) == (
        "named in [yield] programs ('*firefox*')",
        False,
    )


# -- next_aside: a new step aside ------------------------------------------------------------


def test_nothing_seen_no_step_aside() -> None:
    assert look(None) is None
    assert look(None, Sighting(GAME, 10)) is None


def test_a_triggering_program_gets_a_step_aside_from_now() -> None:
    aside = look(None, Sighting(GAME, 4000), now=7.5)
    assert aside == Aside(
        GAME.pid,
        GAME.start,
        "game",
        "holds 3.9 KiB of device memory ([yield] min_bytes is 1000 B)",
        7.5,
        by_memory=True,
        used_bytes=4000,
    )
    named = look(None, Sighting(BLENDER), now=2.0)
    assert named is not None
    assert (named.key, named.by_memory, named.used_bytes, named.since) == (
        BLENDER.key,
        False,
        None,
        2.0,
    )


def test_the_daemons_own_processes_never_trigger() -> None:
    assert look(None, Sighting(BLENDER, 5 * GIB), own=(BLENDER.pid,)) is None
    assert look(None, Sighting(GAME, 5 * GIB), own=(GAME.pid, 999)) is None


def test_a_program_resumed_past_never_triggers_but_a_new_one_on_its_pid_does() -> None:
    assert look(None, Sighting(BLENDER), passed=(BLENDER.key,)) is None
    reused = program(BLENDER.pid, "blender", start=BLENDER.start + 1)
    aside = look(None, Sighting(reused), passed=(BLENDER.key,))
    assert aside is not None
    assert aside.key == reused.key


def test_the_program_started_first_is_chosen_whatever_the_order_seen() -> None:
    young = program(5, "blender", start=900)
    old = program(50, "game", start=200)
    sightings = (Sighting(young), Sighting(old, 5000))
    aside = look(None, *sightings)
    assert aside is not None
    assert aside.key == old.key
    aside = look(None, *reversed(sightings))
    assert aside is not None
    assert aside.key == old.key


def test_programs_started_on_the_same_tick_go_by_pid() -> None:
    first, second = program(7, "blender", start=300), program(3, "blender", start=300)
    aside = look(None, Sighting(first), Sighting(second))
    assert aside is not None
    assert aside.pid == 3


def test_a_program_that_does_not_trigger_is_passed_over_for_a_younger_that_does() -> None:
    quiet = program(1, "editor", start=1)
    aside = look(None, Sighting(quiet, 10), Sighting(BLENDER))
    assert aside is not None
    assert aside.key == BLENDER.key


def test_disabled_rules_give_no_new_step_aside() -> None:
    off = YieldRules(enabled=False, programs=("blender",), min_bytes=1000)
    assert look(None, Sighting(BLENDER, 5 * GIB), Sighting(GAME, 5 * GIB), rules=off) is None


# -- next_aside: the one in force ------------------------------------------------------------


def test_the_step_aside_in_force_carries_on_with_its_memory_brought_up_to_date() -> None:
    current = look(None, Sighting(GAME, 4000), now=1.0)
    assert current is not None
    later = look(current, Sighting(GAME, 9000), now=60.0)
    assert later == Aside(
        GAME.pid, GAME.start, "game", current.reason, 1.0, by_memory=True, used_bytes=9000
    )


def test_the_step_aside_in_force_is_kept_over_an_older_program_that_appears() -> None:
    current = look(None, Sighting(BLENDER), now=1.0)
    assert current is not None
    older = program(2, "blender", start=1)
    assert look(current, Sighting(older), Sighting(BLENDER), now=2.0) == current


def test_a_program_that_is_gone_ends_its_step_aside() -> None:
    current = look(None, Sighting(BLENDER), now=1.0)
    assert look(current, now=2.0) is None
    assert look(current, Sighting(GAME, 10), now=2.0) is None


def test_when_the_program_is_gone_another_that_triggers_takes_over() -> None:
    current = look(None, Sighting(BLENDER), now=1.0)
    aside = look(current, Sighting(GAME, 5000), now=2.0)
    assert aside is not None
    assert (aside.key, aside.since, aside.by_memory) == (GAME.key, 2.0, True)


def test_a_reused_pid_is_another_program() -> None:
    current = look(None, Sighting(BLENDER), now=1.0)
    assert current is not None
    stranger = program(BLENDER.pid, "editor", start=BLENDER.start + 5)
    assert look(current, Sighting(stranger, 10), now=2.0) is None
    again = program(BLENDER.pid, "blender", start=BLENDER.start + 5)
    aside = look(current, Sighting(again), now=2.0)
    assert aside is not None
    assert (aside.key, aside.since) == (again.key, 2.0)


def test_a_memory_step_aside_ends_after_grace_s_under_min_bytes() -> None:
    current = look(None, Sighting(GAME, 5000), now=0.0)
    assert current is not None
    current = look(current, Sighting(GAME, 500), now=1.0)
    assert current is not None
    assert (current.below_since, current.used_bytes) == (1.0, 500)
    current = look(current, Sighting(GAME, 0), now=5.0)
    assert current is not None
    assert current.below_since == 1.0  # kept from the first look under
    current = look(current, Sighting(GAME, 999), now=10.9)
    assert current is not None
    assert look(current, Sighting(GAME, 999), now=11.0) is None


def test_going_back_over_min_bytes_restarts_the_grace() -> None:
    current = look(None, Sighting(GAME, 5000), now=0.0)
    current = look(current, Sighting(GAME, 500), now=1.0)
    current = look(current, Sighting(GAME, 1000), now=3.0)  # at min_bytes: over again
    assert current is not None
    assert (current.below_since, current.used_bytes) == (None, 1000)
    current = look(current, Sighting(GAME, 500), now=5.0)
    assert current is not None
    assert current.below_since == 5.0
    current = look(current, Sighting(GAME, 500), now=14.9)
    assert current is not None  # 13.9 s after the first look under: the grace began again
    assert look(current, Sighting(GAME, 500), now=15.0) is None


def test_when_a_memory_step_aside_ends_another_program_may_take_over() -> None:
    current = look(None, Sighting(GAME, 5000), now=0.0)
    current = look(current, Sighting(GAME, 0), now=1.0)
    aside = look(current, Sighting(GAME, 0), Sighting(BLENDER), now=11.0)
    assert aside is not None
    assert (aside.key, aside.since) == (BLENDER.key, 11.0)


def test_a_named_step_aside_never_ends_by_memory() -> None:
    current = look(None, Sighting(BLENDER, 5000), now=0.0)
    for now in (1.0, 20.0, 1000.0):
        current = look(current, Sighting(BLENDER, 0), now=now)
        assert current is not None
        assert (current.used_bytes, current.below_since) == (0, None)


def test_unmeasured_memory_never_counts_as_under_min_bytes() -> None:
    current = look(None, Sighting(GAME, 5000), now=0.0)
    assert current is not None
    assert look(current, Sighting(GAME, None), now=100.0) == current
    # The grace starts at the first measure under, not at a look that measured nothing.
    current = look(current, Sighting(GAME, 0), now=101.0)
    assert current is not None
    assert current.below_since == 101.0
    assert look(current, Sighting(GAME, None), now=500.0) == current


def test_a_step_aside_in_force_carries_on_when_rules_are_disabled() -> None:
    off = YieldRules(enabled=False, programs=("blender",), min_bytes=1000)
    current = asked(GAME, 1.0)
    assert look(current, Sighting(GAME, 0), rules=off, now=50.0) == replace(current, used_bytes=0)


# -- asked -----------------------------------------------------------------------------------


def test_asked_steps_aside_until_the_program_exits() -> None:
    aside = asked(GAME, 3.0)
    assert aside == Aside(GAME.pid, GAME.start, "game", ASKED, 3.0, by_memory=False)
    # It triggers by nothing, yet lasts while the program runs, however little it holds...
    carried = look(aside, Sighting(GAME, 0), now=1000.0)
    assert carried == replace(aside, used_bytes=0)
    # ...and the program's pid alone does not keep it.
    assert look(aside, Sighting(program(GAME.pid, "game", start=GAME.start + 1), 0)) is None
