"""A `vllm serve` command line copied to `pdserve up` (pdserve/up_flags.py, pdserve/cli.py): the
model where CONFIG goes (a .gguf file, a model folder, a Hub id) taken as --model, and a binary
file there refused in one line without being read whole; vLLM's flags mapped to the YAML key
pdserve has for them (-tp, --[no-]enable-prefix-caching, --seed, --kv-cache-memory-bytes,
--disable-log-stats), taken with a note where they change nothing here, refused in one line that
names pdserve's key otherwise, never with their value taken for CONFIG; vLLM's spellings of values
(--dtype half, --max-model-len 32k, --quantization awq on an AWQ checkpoint, several
--api-key); and the note on --port, which is pdserve's gRPC port and vLLM's HTTP port. Only
`up --check` runs: nothing starts, and no port is probed but port 0."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers.up import flags_config as _up
from pdserve import cli, up_flags
from pdserve.cli import main
from pdserve.deploy.config import files
from pdserve.deploy.config.load import ConfigError, read_config_data

QUIET = ["--port", "0", "--http-port", "off"]  # no port probed


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- F1, F2: the model where CONFIG goes ---------------------------------------------------------
def test_a_model_folder_where_the_yaml_goes_is_served_as_vllm_serve_would(tiny_models, capsys):
    model_dir, _ = tiny_models("llama-gqa")
    assert main(["up", model_dir, "--check", *QUIET]) == 0
    out = capsys.readouterr().out
    assert f"ok ({model_dir};" in out


def test_a_gguf_or_a_hub_id_where_the_yaml_goes_is_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for model in ("some/dir/model.Q4_K_M.gguf", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B@main"):
        config = _up(tmp_path, None, model)
        assert config.model == model
    assert _up(tmp_path, None, "smollm2", "--tp", "2").pools.decode.tp == 2
    # the same model given twice is one model; two different ones are refused
    assert _up(tmp_path, None, "Org/Name", "--model", "Org/Name").model == "Org/Name"
    with pytest.raises(ConfigError, match="the model is given twice"):
        _up(tmp_path, None, "Org/Name", "--model", "Other/Name")


def test_an_existing_file_is_still_the_yaml_whatever_its_name(tmp_path, monkeypatch):
    """Every `pdserve up CONFIG` form that worked goes on working: a file of that name is the
    YAML, even one spelled like a Hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org").mkdir()
    (tmp_path / "Org" / "Name").write_text("model: from-the-yaml\n")
    (tmp_path / "deploy.yml").write_text("model: yml\n")
    assert up_flags.positional_model("Org/Name") is None
    assert up_flags.positional_model("deploy.yml") is None
    assert up_flags.positional_model("missing.yaml") is None  # reading it says it is missing
    assert read_config_data("Org/Name") == {"model": "from-the-yaml"}


def test_a_binary_file_where_the_yaml_goes_is_one_line_and_never_read_whole(
    tmp_path, monkeypatch, capsys
):
    blob = tmp_path / "weights.dat"
    blob.write_bytes(bytes(range(256)) * 64)  # 16 KiB, not UTF-8
    sizes = []
    real_open = open

    class Spy:  # the file, with the size of each read asked recorded
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def read(self, n=-1):
            sizes.append(n)
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(files, "MAX_TEXT_FILE_BYTES", 1024)
    monkeypatch.setattr(files, "open", Spy, raising=False)
    assert main(["up", str(blob), "--check"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"pdserve: {blob}: not a text file (over 1024 bytes)"), line
    assert "--model" in line and "Traceback" not in line
    assert sizes == [1025]  # the cap and one byte, not the file
    monkeypatch.setattr(files, "MAX_TEXT_FILE_BYTES", 1 << 20)
    assert main(["up", str(blob), "--check"]) == 2
    assert "not a text file (byte 128 is not UTF-8)" in _one_line(capsys)


def test_what_is_neither_a_yaml_nor_a_model_is_one_line_that_says_what_config_may_be(
    tmp_path, capsys
):
    gguf_by_another_name = tmp_path / "model.bin.part"
    gguf_by_another_name.write_bytes(b"GGUF\x03\x00\x00\x00")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00" * 16)
    for value, says in (
        (str(tmp_path), "a folder with no config.json"),
        (str(gguf_by_another_name), "a GGUF file, which pdserve loads by its .gguf name"),
        (str(weights), "a weights file; serve its folder"),
        ("0.9", "0.9: no such file or directory; CONFIG is a deployment YAML"),
    ):
        assert main(["up", value, "--check"]) == 2
        line = _one_line(capsys)
        assert says in line, line


# ---- F3: --port ----------------------------------------------------------------------------------
def test_port_without_http_port_says_where_http_is(tiny_models, capsys):
    model_dir, _ = tiny_models("llama-gqa")
    assert main(["up", "--check", "--model", model_dir, "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert (
        "note: --port 0 is the router's gRPC port; the OpenAI-compatible HTTP front takes a free "
        "port (vLLM's --port is --http-port here)" in err
    )
    assert main(["up", "--check", "--model", model_dir, *QUIET]) == 0
    assert "--port is --http-port here" not in capsys.readouterr().err  # --http-port given
    # vLLM's own default, written out: the clash is refused, and the note says why
    assert main(["up", "--check", "--port", "8000"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "http_port and port are both 8000" in err[0] and "(given by --port)" in err[0]
    assert err[1].startswith("pdserve: note: --port 8000 is the router's gRPC port")


def test_port_note_names_the_http_port_the_deployment_has(tmp_path):
    import argparse

    args = argparse.Namespace(port="9000", http_port=None)
    assert "stays on :8000" in up_flags.port_note(args, _up(tmp_path, None, "--port", "9000"))
    off = _up(tmp_path, {"router": {"http_port": None}}, "--port", "9000")
    assert "is off (router.http_port: null)" in up_flags.port_note(args, off)
    assert up_flags.port_note(argparse.Namespace(port=None, http_port=None), off) is None


# ---- F4: vLLM's serve flags ----------------------------------------------------------------------
def test_vllm_flags_with_a_key_here_set_it(tmp_path):
    c = _up(tmp_path, None, "-tp", "2", "--no-enable-prefix-caching", "--seed", "7")
    assert c.pools.prefill.tp == c.pools.decode.tp == 2
    assert not c.pools.prefill.enable_prefix_caching and not c.pools.decode.enable_prefix_caching
    assert c.seed == 7 and c.engine_kwargs(c.pools.decode)["seed"] == 7
    assert _up(tmp_path, None).engine_kwargs(_up(tmp_path, None).pools.decode)["seed"] == 0
    yaml_off = {"pools": {"decode": {"enable_prefix_caching": False}}}
    assert _up(tmp_path, yaml_off, "--enable-prefix-caching").pools.decode.enable_prefix_caching
    c = _up(tmp_path, None, "--kv-cache-memory-bytes", "1G", "--disable-log-stats")
    assert c.pools.prefill.kv_cache_memory == c.pools.decode.kv_cache_memory == 1 << 30
    assert c.observability.stats_interval_s == 0


def test_a_pool_flag_changes_that_pool_alone_where_the_yaml_aliases_one_pool_as_the_other(
    tmp_path,
):
    pool = {"replicas": 1, "kv_cache_memory": 1 << 22}
    c = _up(tmp_path, {"pools": {"prefill": pool, "decode": pool}}, "--prefill-tp", "2")
    assert "&id" in (tmp_path / "deploy.yaml").read_text()  # (an anchor, and its alias)
    assert (c.pools.prefill.tp, c.pools.decode.tp) == (2, 1)


def test_a_refused_prefix_cache_names_the_flag_that_turned_it_off(tmp_path):
    tiered = {"pools": {"decode": {"kv_host_tier_bytes": 1 << 20}}}
    with pytest.raises(ConfigError, match="given by --no-enable-prefix-caching"):
        _up(tmp_path, tiered, "--no-enable-prefix-caching")


REFUSED = [
    (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory-bytes N"),
    (["--uvicorn-log-level", "warning"], "--log-level (observability.log_level)"),
    (["--no-enable-chunked-prefill"], "pools.*.max_num_batched_tokens"),
    (["--enable-log-requests"], "--capture-trace FILE"),
    (["-pp", "2"], "--prefill-pp N (pools.prefill.pp)"),
    (["--data-parallel-size", "2"], "--decode-replicas"),
    (["--revision", "main"], "--model ORG/NAME@REVISION"),
]


@pytest.mark.parametrize("argv,names", REFUSED, ids=[a[0] for a, _ in REFUSED])
def test_a_vllm_flag_with_no_counterpart_is_one_line_naming_pdserves_key(argv, names, capsys):
    assert main(["up", *argv, "--check"]) == 2
    line = _one_line(capsys)
    assert line.startswith("pdserve: --") and ": not supported: " in line, line
    assert names in line, line
    assert "no such file" not in line  # its value was not taken for CONFIG


def test_vllm_flags_that_change_nothing_here_run_with_a_note(tiny_models, capsys):
    model_dir, _ = tiny_models("llama-gqa")
    argv = ["--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests"]
    assert main(["up", "--check", "--model", model_dir, *argv, "--max-log-len", "100", *QUIET]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "no effect here" in line]
    assert [n.split(":")[2].strip() for n in notes] == [
        "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
        "--max-log-len 100",
    ]  # fmt: skip
    assert "never runs a checkpoint's own Python code" in notes[0]


def test_an_unknown_flag_is_one_line_naming_it_and_the_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", "--no-such-flag", "3", "--check"])
    assert e.value.code == 2
    assert _one_line(capsys) == (
        "pdserve up: unrecognized argument: --no-such-flag (see `pdserve up --help`)"
    )


# ---- F5: vLLM's spellings of values --------------------------------------------------------------
def test_vllm_s_dtype_spellings():
    for given, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        args = cli._parser().parse_args(["up", "--dtype", given])
        assert cli._mode_overrides(args)["dtype"] == dtype


def test_an_fp8_kv_cache_is_refused_with_what_pdserve_offers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", "--kv-cache-dtype", "fp8", "--check"])
    assert e.value.code == 2
    line = _one_line(capsys)
    assert line.startswith("pdserve up: argument --kv-cache-dtype: 'fp8': ")
    assert "float32, float16 or bfloat16" in line and line.endswith("(see `pdserve up --help`)")


@pytest.mark.parametrize(
    "value,n",
    [
        ("4096", 4096),
        ("32k", 32000),
        ("32K", 32768),
        ("1.5k", 1500),
        ("1M", 1 << 20),
        ("2g", 2_000_000_000),
    ],
)
def test_vllm_s_human_readable_integers(value, n):
    assert up_flags.human_int("--max-model-len", value) == n


@pytest.mark.parametrize("value", ["1.5K", "32q", "-1", "auto", ""])
def test_a_bad_human_readable_integer_names_its_flag(value):
    with pytest.raises(ConfigError, match="^--max-num-batched-tokens: "):
        up_flags.human_int("--max-num-batched-tokens", value)


def test_max_model_len_takes_vllm_s_suffixes(tmp_path):
    assert _up(tmp_path, None, "--max-model-len", "2k").pools.decode.max_model_len == 2000
    assert (
        _up(tmp_path, None, "--max-num-batched-tokens", "4K").pools.decode.max_num_batched_tokens
        == 4096
    )


def test_vllm_s_quantization_is_taken_when_the_checkpoint_is_so(tiny_models, tmp_path, capsys):
    model_dir, _ = tiny_models("llama-gqa")
    awq = tmp_path / "awq-model"
    shutil.copytree(model_dir, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (awq / "config.json").write_text(json.dumps(config))
    assert "reads the checkpoint's own quantization (awq)" in up_flags.checkpoint_quantization(
        str(awq), "awq_marlin", True
    )
    with pytest.raises(ConfigError, match="the checkpoint is quantized with awq, and pdserve"):
        up_flags.checkpoint_quantization(str(awq), "gptq", True)
    assert "not checked here" in up_flags.checkpoint_quantization("Org/Name", "fp8", False)
    # a float checkpoint: `up` refuses before anything starts
    assert main(["up", "--check", "--model", model_dir, "--quantization", "fp8", *QUIET]) == 2
    line = _one_line(capsys)
    assert line.startswith("pdserve: --quantization fp8: the checkpoint is not quantized, and")
    with pytest.raises(SystemExit):
        main(["up", "-q", "bitsandbytes", "--check"])
    line = _one_line(capsys)
    assert line.startswith("pdserve up: argument --quantization/-q: 'bitsandbytes': ")
    assert "reads a checkpoint quantized ahead (gptq, awq, compressed-tensors, fp8, mxfp4)" in line
    args = cli._parser().parse_args(["up", "--quantization", "awq"])
    assert "quantization" not in cli._mode_overrides(args)  # not pdserve's own CPU quantization


# ---- F6: vLLM's multi-value flags ----------------------------------------------------------------
def test_several_api_keys_after_one_flag_are_all_keys(tmp_path):
    keys = ("sk-first-key-0001", "sk-second-key-002", "sk-third-key-0003")
    c = _up(tmp_path, None, "--api-key", keys[0], keys[1], "--api-key", keys[2])
    assert c.router.client_keys({})[0] == keys


def test_several_served_model_names_are_the_id_then_aliases(tmp_path, capsys):
    assert _up(tmp_path, None, "--served-model-name", "mine").served_model_name == "mine"
    c = _up(tmp_path, None, "--served-model-name", "a", "b", "c")
    assert c.served_model_name == ["a", "b", "c"]
    assert (c.served_model_id(), c.served_model_aliases()) == ("a", ("b", "c"))
    assert main(["up", "--served-model-name", "a", "a", "--check"]) == 2
    line = _one_line(capsys)
    assert line.startswith("pdserve: ") and "--served-model-name names ['a'] more than once" in line
