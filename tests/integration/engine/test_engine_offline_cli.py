"""`pdserve offline`: several prompts concurrently, JSON lines in input order, --tp 2."""

from __future__ import annotations

import json

import pytest

from services.common.cli import main


def _run(capsys, argv):
    assert main(["offline", *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_offline_json_matches_transformers_in_input_order(tiny_model, prompts_of, capsys, tmp_path) -> None:
    model = tiny_model("qwen2_bias")
    prompts = prompts_of([9, 30, 4], seed=31)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt_ids": prompts[2]}) + "\n")
    argv = ["--model", str(model.path), "--max-tokens", "12", "--json", "--kv-cache-memory", "4MiB", "--dtype", "float32",
            "--prompt-ids", ",".join(map(str, prompts[0])), "--prompt-ids", ",".join(map(str, prompts[1])),
            "--jsonl", str(jsonl)]
    rows = _run(capsys, argv)
    assert [r["token_ids"] for r in rows] == [model.reference(p, 12) for p in prompts]
    assert all(r["finish_reason"] == "length" and r["num_cached_tokens"] == 0 and r["text"] == "" for r in rows)
    assert set(rows[0]) == {"token_ids", "text", "finish_reason", "num_cached_tokens"}
    assert _run(capsys, [*argv, "--tp", "2"]) == rows


def test_offline_bad_input_exits_2(tiny_model, capsys) -> None:
    path = str(tiny_model("qwen2_bias").path)
    assert main(["offline", "--model", path, "--prompt-ids", "1,x"]) == 2
    assert main(["offline", "--model", path, "--prompt-ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit, match='^2$'):
        main(["offline", "--model", path, "--max-tokens", "many"])
