"""What a reload does to each model, as a pure function of the old and new [models] tables (the
reload itself runs through a real daemon in tests/daemon/test_serve.py and
test_serve_configwatch.py)."""

from __future__ import annotations

from arbiterd.daemon.reload import ReloadPlan, plan_reload
from tests.support.models import model_config


def test_a_reload_adds_removes_and_restarts_by_the_models_tables() -> None:
    old = {
        "kept": model_config("kept"),
        "renamed": model_config("renamed"),
        "grown": model_config("grown"),
        "gone": model_config("gone"),
    }
    new = {
        "kept": model_config("kept", unload_after_s=60.0),  # only the daemon reads it
        "renamed": model_config("renamed", aliases=("r",)),
        "grown": model_config("grown", n_ctx=4096),  # a new worker
        "new": model_config("new"),
    }
    assert plan_reload(old, new, failed=()) == ReloadPlan(
        added=("new",), removed=("gone",), changed=("grown",), aliases_changed=("renamed",)
    )


def test_a_failed_model_restarts_on_reload_though_its_table_is_the_same() -> None:
    models = {"m": model_config("m"), "n": model_config("n")}
    plan = plan_reload(models, models, failed=("n",))
    assert plan == ReloadPlan(added=(), removed=(), changed=("n",), aliases_changed=())
