"""config.toml's tools and chat-template keys (issue 30): `tools = "refuse"`, and a
`chat_template` or `chat_template_file` checked at load, its errors naming the model and the
line of the template."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.config import Tools, load_config
from arbiterd.errors import ConfigError
from arbiterd.spec import WorkerConfig
from tests.config.test_config import write
from tests.support.tiny_gguf import CHAT_TEMPLATE

MODEL = '[models.chat]\npath = "/models/chat.gguf"\n'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A private environment: HOME and a 0700 XDG_RUNTIME_DIR under tmp_path."""
    (tmp_path / "home").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    return {"HOME": str(tmp_path / "home"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}


def _spec(tmp_path: Path, environ: dict[str, str], extra: str) -> WorkerConfig:
    config = load_config(write(tmp_path, MODEL + extra), env=environ)
    return config.models["chat"].worker_config(tmp_path, embedding=False, n_ctx=2048)


def test_tools_are_offered_unless_refused(tmp_path: Path, env: dict[str, str]) -> None:
    assert _spec(tmp_path, env, "").spec.tools
    refused = load_config(write(tmp_path, MODEL + 'tools = "refuse"\n'), env=env)
    assert refused.models["chat"].tools is Tools.REFUSE
    assert not _spec(tmp_path, env, 'tools = "refuse"\n').spec.tools
    with pytest.raises(ConfigError, match=r'models\.chat\.tools: expected one of "offer"'):
        _spec(tmp_path, env, 'tools = "never"\n')


def test_a_chat_template_reaches_the_worker(tmp_path: Path, env: dict[str, str]) -> None:
    literal = CHAT_TEMPLATE  # a TOML literal string: no escapes
    spec = _spec(tmp_path, env, f"chat_template = '''{literal}'''\n").spec
    assert spec.chat_template == CHAT_TEMPLATE
    assert (
        WorkerConfig.from_json(
            _spec(tmp_path, env, f"chat_template = '''{literal}'''\n").to_json()
        ).spec.chat_template
        == CHAT_TEMPLATE
    )
    assert _spec(tmp_path, env, "").spec.chat_template is None


def test_a_chat_template_file_is_read_beside_the_config(
    tmp_path: Path, env: dict[str, str]
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "chat.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    spec = _spec(tmp_path, env, 'chat_template_file = "chat.jinja"\n').spec
    assert spec.chat_template == CHAT_TEMPLATE
    with pytest.raises(ConfigError, match=r"models\.chat\.chat_template_file: cannot read .*gone"):
        _spec(tmp_path, env, 'chat_template_file = "gone.jinja"\n')


def test_a_template_that_does_not_parse_names_the_model_and_line(
    tmp_path: Path,
    env: dict[str, str],
) -> None:
    broken = "{{ bos_token }}\n{% for m in messages %}\n{{ m.content }"
    with pytest.raises(
        ConfigError,
        match=r"models\.chat\.chat_template: line 3 of the chat template does not parse",
    ):
        _spec(tmp_path, env, f"chat_template = '''{broken}'''\n")


def test_a_template_file_without_a_generation_prompt_is_an_error(
    tmp_path: Path,
    env: dict[str, str],
) -> None:
    (tmp_path / "etc").mkdir()
    path = tmp_path / "etc" / "flat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    with pytest.raises(
        ConfigError, match=r"models\.chat\.chat_template_file: .*renders no generation prompt"
    ):
        _spec(tmp_path, env, 'chat_template_file = "flat.jinja"\n')


def test_a_template_and_a_chat_format_or_two_templates_conflict(
    tmp_path: Path,
    env: dict[str, str],
) -> None:
    literal = CHAT_TEMPLATE  # a TOML literal string: no escapes
    with pytest.raises(ConfigError, match="chat_format or a chat template, not both"):
        _spec(tmp_path, env, f"chat_format = 'chatml'\nchat_template = '''{literal}'''\n")
    with pytest.raises(ConfigError, match="chat_template or chat_template_file, not both"):
        _spec(tmp_path, env, f"chat_template = '''{literal}'''\nchat_template_file = 'x'\n")
