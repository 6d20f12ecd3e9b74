"""End to end: ``behemoth train`` writes a checkpoint, ``behemoth export`` turns it into a
transformers checkpoint that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load (GPT-2 tokenizer
files, padded vocabulary trimmed, logits of the trained weights), and the export streams: the
exporting process's peak resident memory (VmHWM, reset before the export) grows by less than the largest tensor plus one output
shard, for a model several times that size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_cli import DEMO, behemoth

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(tmp_path, out_dir, *overrides):
    r = behemoth(
        "train",
        DEMO,
        "--train.steps=1",
        "--train.global_batch_size=2",
        "--optim.warmup_steps=0",
        f"--train.out_dir={out_dir}",
        *overrides,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(600)
def test_export_command_with_gpt2_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from behemoth.models import build_model
    from behemoth.train.run_dir import load_weights
    from behemoth.train.tokenizer import get_tokenizer

    run = tmp_path / "run"
    _train(
        tmp_path,
        run,
        "--model.name=gpt-tiny",
        "--model.seq_len=32",
        "--model.vocab_size=50304",
        "--data.tokenizer=gpt2",
        "--data.default_corpus_bytes=20000",
    )
    r = behemoth("export", str(run), str(tmp_path / "hf"), "--max-shard-size=4MB", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exported" in r.stdout and "step-1" in r.stdout and "vocabulary 50257" in r.stdout, r.stdout
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info
    assert hf.config.vocab_size == 50257 and hf.config.eos_token_id == 50256
    ours = build_model("gpt-tiny", vocab_size=50304, seq_len=32).eval()
    load_weights(ours, str(run / "checkpoints" / "step-1"))
    text = "def export(checkpoint):\n    return transformers"
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = get_tokenizer("gpt2").encode(text)
    assert tok(text)["input_ids"] == ids and tok.eos_token_id == 50256
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, ours(x)[..., :50257], atol=1e-5, rtol=1e-4)
    r = behemoth("export", str(tmp_path / "nowhere"), str(tmp_path / "hf2"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "neither a complete checkpoint" in r.stderr, r.stderr


_MEASURE = textwrap.dedent(
    """
    import json, sys
    from behemoth.hf.export import CheckpointTensors, export_checkpoint

    def status(key):  # kB -> bytes, from /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    ckpt, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
    CheckpointTensors(ckpt).read("ln_f.weight")  # DCP's one-off set-up, outside the measured part
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    before = status("VmRSS")
    info = export_checkpoint(ckpt, out, max_shard_size=shard)
    print(json.dumps({"growth": status("VmHWM") - before, "peak_bytes": info["peak_bytes"], "files": info["files"]}))
    """
)


@pytest.mark.timeout(600)
def test_export_streams_tensor_by_tensor(tmp_path):
    run = tmp_path / "run"
    # 8 layers x 512 wide: 25M parameters, 100 MB in fp32; the largest tensor is 4 MB
    _train(
        tmp_path,
        run,
        "--model.name=gpt-tiny",
        "--model.seq_len=32",
        "--model.num_layers=8",
        "--model.hidden=512",
        "--model.num_heads=8",
        "--model.vocab_size=1024",
        "--data.default_corpus_bytes=20000",
    )
    ckpt = str(run / "checkpoints" / "step-1")
    shard = 20 * 10**6
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, ckpt, str(tmp_path / "hf"), str(shard)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    largest = 4 * 512 * 512 * 4  # mlp.fc: [2048, 512] fp32
    model_bytes = sum((tmp_path / "hf" / f).stat().st_size for f in got["files"])
    assert model_bytes > 100 * 10**6 and len(got["files"]) >= 5, got
    assert got["peak_bytes"] == largest, got  # the writer held one tensor at a time
    assert got["growth"] < largest + shard, (got, largest + shard)  # the process: below one tensor + one shard
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert hf.config.n_layer == 8 and hf.config.vocab_size == 257
