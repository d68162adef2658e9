"""benchmarks/serve_latency.py against a real demo server: its reused arm reuses the kept prefix,
its cold arm has none to reuse (else the two times would not measure what the table says), and
side calls run beside the main turn."""

from __future__ import annotations

import importlib.util

import pytest

from tests.server_util import ROOT, start_server

pytest.importorskip("openai")
pytest.importorskip("fastapi")


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_latency",
                                                  ROOT / "benchmarks" / "serve_latency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_latency_arms(tmp_path, capsys):
    server = start_server(tmp_path, "--parallel", "2", "--context", "1024")
    try:
        out = tmp_path / "latency.json"
        rc = load_bench().main(["--url", server.base_url, "--history", "300", "--sides", "0,1",
                                "--reps", "1", "--main-tokens", "8", "--side-tokens", "4",
                                "--json", str(out)])
        assert rc == 0, capsys.readouterr().err
    finally:
        server.stop()
    import json
    r = json.loads(out.read_text())
    (t,) = r["ttft"]
    prompt = t["prompt_tokens"][0]
    assert 250 <= prompt <= 400, t  # the history asked for, within the calibration's error
    assert t["cached_tokens_reuse"][0] > 0.8 * prompt, t  # turn 1's state reused
    assert t["cached_tokens_cold"] == [0], t  # the cold arm prefilled everything
    alone, beside = r["decode"]
    assert (alone["sides"], alone["side_calls"]) == (0, 0)
    assert beside["sides"] == 1 and beside["side_calls"] >= 1, beside
    assert alone["main_tokens"] == beside["main_tokens"] == 8  # ignore_eos: all of them
    assert alone["main_decode_tok_s"] > 0 and beside["main_decode_tok_s"] > 0  # the server's
