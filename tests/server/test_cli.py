"""The command line: every engine and server option is a flag of `pagedchat serve`, every option the README
shows exists, and `pagedchat chat` streams a piped conversation."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import (
    _DERIVED,
    build_parser,
    engine_config_from_args,
    server_settings_from_args,
)
from app.cli import serve as cli_serve
from app.engine_options import ENGINE_OPTIONS
from app.options import parse_bytes
from app.server_options import SERVER_OPTIONS
from app.settings import ServerSettings
from engine.config import EngineConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _help(command: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[command].format_help()


def test_every_engine_and_server_option_is_a_serve_flag():
    help_text = _help("serve")
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _DERIVED]
    names += [f.name for f in dataclasses.fields(ServerSettings) if f.name != "engine"]
    for name in names:
        assert "--" + name.replace("_", "-") in help_text


def test_every_option_the_readme_shows_exists():
    table_rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    shown = {flag for row in table_rows for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", row)}
    assert {"--host", "--port", "--redis-url", "--api-key", "--max-queue", "--model"} <= shown
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", _help("serve") + _help("chat")))
    assert shown <= flags, shown - flags


def test_serve_flags_reach_the_server_settings():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--max-queue",
            "3",
            "--redis-url",
            "redis://x:1/0",
            "--max-num-seqs",
            "7",
        ]
    )
    settings = server_settings_from_args(args)
    assert (
        settings.port,
        settings.api_key,
        settings.max_queue,
        settings.redis_url,
        settings.engine.max_num_seqs,
    ) == (9001, "k", 3, "redis://x:1/0", 7)


def test_every_engine_option_is_a_chat_flag():
    help_text = _help("chat")
    for field in dataclasses.fields(EngineConfig):
        if field.name not in _DERIVED:
            assert "--" + field.name.replace("_", "-") in help_text


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        [
            "chat",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-gib",
            "0.5",
            "--prefix-hash",
            "xxh128",
            "--kv-cache-dtype",
            "fp8",
            "--device",
            "cpu",
        ]
    )
    config = engine_config_from_args(args)
    assert (
        config.block_size,
        config.enable_prefix_caching,
        config.kv_cache_memory_gib,
        config.prefix_hash,
        config.kv_cache_dtype,
    ) == (32, False, 0.5, "xxh128", "fp8")


def test_bad_flag_value_exits_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--block-size", "12"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and "block_size" in result.stderr


def test_piped_chat_streams_a_reply_with_stats():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "chat",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--kv-cache-memory-gib",
            "0.1",
            "--num-threads",
            "1",
            "--log-level",
            "WARNING",
        ],
        input="What is 2 + 2?\nAnd 3 + 3?\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    stats = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("[") and "tokens, TTFT" in line
    ]
    assert len(stats) == 2, result.stderr
    assert result.stdout.strip(), "the replies are printed on stdout"
    second_turn_cached = int(stats[1].split("of which ")[1].split(" cached")[0])
    assert second_turn_cached > 0, "the second turn re-sends the first: its blocks must be hit"


def show_bytes(value: int) -> str:
    """A size as --help shows its default (``8MiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}B"


# the help text ----------------------------------------------------------------------------------------------


def _actions(command: str) -> list:
    return [
        a
        for a in build_parser()._subparsers._group_actions[0].choices[command]._actions
        if a.dest != "help"
    ]


def test_every_flag_has_a_help_sentence_and_its_default():
    for command in ("serve", "chat"):
        for action in _actions(command):
            text = action.help or ""
            sentence = text.split("Default:")[0].strip()
            assert len(sentence) >= 12 and "Default: " in text, (
                command,
                action.option_strings,
                text,
            )


def test_the_options_table_matches_the_dataclasses_and_their_defaults():
    for options, cls, skip in (
        (ENGINE_OPTIONS, EngineConfig, _DERIVED),
        (SERVER_OPTIONS, ServerSettings, {"engine"}),
    ):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
        assert [o.name for o in options] == list(fields)
        for option in options:
            field = fields[option.name]
            if field.default is dataclasses.MISSING or field.default is None:
                continue  # (computed, from the environment, or "none": the text says which)
            shown = {"bool": lambda v: "on" if v else "off", "bytes": show_bytes}.get(
                option.kind, str
            )(field.default)
            assert option.default.split(" ")[0] == shown, (option.name, option.default, shown)


def test_choices_are_the_engines_own():
    from engine.config import (
        ALL_REDUCE_CHOICES,
        CPU_WEIGHTS,
        DTYPES,
        KV_BACKENDS,
        KV_CACHE_DTYPES,
        LOAD_FORMATS,
        PREEMPTION_MODES,
        PREFIX_HASHES,
        SPECULATIVE_METHODS,
    )
    from engine.worker.dummy_model import DUMMY_ARCHITECTURES
    from kernels.cpu_native import CPU_ISA_CHOICES

    choices = {o.name: set(o.choices) for o in ENGINE_OPTIONS if o.choices}
    assert choices == {
        "load_format": set(LOAD_FORMATS),
        "model_config": set(DUMMY_ARCHITECTURES),
        "dtype": {"auto", *DTYPES},
        "device": {"auto", "cpu", "cuda"},
        "prefix_hash": set(PREFIX_HASHES),
        "preemption_mode": set(PREEMPTION_MODES),
        "kv_backend": set(KV_BACKENDS),
        "kv_cache_dtype": set(KV_CACHE_DTYPES),
        "cpu_weights": {"auto", *CPU_WEIGHTS},
        "cpu_isa": set(CPU_ISA_CHOICES),
        "all_reduce": set(ALL_REDUCE_CHOICES),
        "speculative": set(SPECULATIVE_METHODS) - {None},  # (None: off)
    }


def test_help_and_version_answer_without_importing_torch():
    code = (
        "import sys, contextlib, io\nfrom app.cli import build_parser\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try: build_parser().parse_args(['serve', '--help'])\n    except SystemExit: pass\n"
        "print('torch' in sys.modules, '--max-num-seqs' in out.getvalue())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["False", "True"]
    version = subprocess.run(
        [sys.executable, "-m", "app", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and re.fullmatch(r"pagedchat \S+\n", version.stdout)


def test_the_model_may_be_given_as_the_first_argument():
    args = build_parser().parse_args(["serve", "/models/llama", "--port", "9000"])
    assert server_settings_from_args(args).engine.model == "/models/llama"
    twice = build_parser().parse_args(["serve", "/models/a", "--model", "/models/b"])
    with pytest.raises(ValueError, match="model: given twice"):
        server_settings_from_args(twice)


def test_sizes_take_units_and_a_bad_size_or_choice_is_one_line_and_status_2():
    args = build_parser().parse_args(
        ["serve", "--max-request-bytes", "4MiB", "--max-session-bytes", "512KiB"]
    )
    settings = server_settings_from_args(args)
    assert (settings.max_request_bytes, settings.max_session_bytes) == (4 * 2**20, 512 * 2**10)
    assert parse_bytes("1.5GB") == 1_500_000_000 and show_bytes(8 * 2**20) == "8MiB"
    for flags, said in (
        (["--max-request-bytes", "4 lots"], "--max-request-bytes"),
        (["--kv-disk-size", "12parsecs"], "argument --kv-disk-size: '12parsecs'"),
        (["--log-level", "verbose"], "invalid choice: 'verbose'"),
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "app", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_size_option_reads_its_environment_variable_with_units(monkeypatch):
    """EngineConfig.kv_disk_size holds bytes, so its variable (PAGEDCHAT_KV_DISK_SIZE) is parsed by the CLI."""
    monkeypatch.setenv("PAGEDCHAT_KV_DISK_SIZE", "512MiB")
    config = engine_config_from_args(build_parser().parse_args(["chat"]))
    assert config.kv_disk_size == 512 * 2**20
    given = build_parser().parse_args(["serve", "--kv-disk-size", "3GB"])
    assert server_settings_from_args(given).engine.kv_disk_size == 3 * 10**9  # the flag wins
    monkeypatch.delenv("PAGEDCHAT_KV_DISK_SIZE")
    assert engine_config_from_args(build_parser().parse_args(["chat"])).kv_disk_size == 2 * 2**30


def test_served_model_names_are_comma_separated_and_each_is_checked(monkeypatch, capsys):
    args = build_parser().parse_args(["serve", "--served-model-name", "smol, org/smol-v2"])
    assert server_settings_from_args(args).served_model_name == ["smol", "org/smol-v2"]
    monkeypatch.setenv("PAGEDCHAT_SERVED_MODEL_NAME", "a,b,c")
    assert ServerSettings().served_model_name == ["a", "b", "c"]
    monkeypatch.delenv("PAGEDCHAT_SERVED_MODEL_NAME")
    assert ServerSettings().served_model_name is None  # (the model directory's name)
    for given, said in (
        ("smol,,other", "name 2 is empty"),
        (" ", "name 1 is empty"),
        ("smol,my model", "name 2 ('my model') holds whitespace"),
        ("smol,bell\x07", "name 2 ('bell\\x07') holds whitespace or a control"),
        ("smol,other,smol", "'smol' given twice"),
        (",".join(f"m{i}" for i in range(17)), "give 1 to 16 names"),
        ("m" * 257, "name 1 has 257 characters; at most 256"),
    ):
        bad = build_parser().parse_args(["serve", "--served-model-name", given])
        with pytest.raises(ValueError, match=re.escape(f"served_model_name: {said}")):
            server_settings_from_args(bad)
    assert ServerSettings(served_model_name=["m" * 256]).served_model_name == ["m" * 256]
    assert cli_serve(build_parser().parse_args(["serve", "--served-model-name", "a,a"])) == 2
    error = capsys.readouterr().err
    assert error == "pagedchat: served_model_name: 'a' given twice\n"


def test_serve_loads_the_positional_models_tokenizer_early(tmp_path, monkeypatch):
    """``pagedchat serve MODEL`` starts loading MODEL's tokenizer first thing, as ``--model MODEL`` does (it loaded
    the default model's, and the engine then loaded MODEL's beside it)."""
    import shutil

    from app.cli import _load_tokenizer_early
    from engine.worker import tokenizer_files
    from engine.worker.model_sources import ensure_default_model
    from engine.worker.tokenizer_files import take_early_tokenizer

    # (none left by an earlier test in this process: the first early load is the one kept)
    monkeypatch.setattr(tokenizer_files, "_early", None)

    # (a directory other than the default model's)
    default = ensure_default_model(Path(EngineConfig().cache_dir))
    model = tmp_path / "model"
    shutil.copytree(default, model, ignore=shutil.ignore_patterns("*.gguf"))
    _load_tokenizer_early(build_parser().parse_args(["serve", str(model)]))
    started = take_early_tokenizer(model)
    assert started is not None, "no early load of the positional model's tokenizer"
    assert started.result(timeout=120).vocab_size > 1000
