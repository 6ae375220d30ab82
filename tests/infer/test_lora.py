"""bin/infer.py --lora ADAPTERS and --merge-lora OUT: the adapters apply to their base only
(checked by hash), and the merged checkpoint synthesises what base + adapters do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from models_testlib import tiny_model

from valle.infer import InputError, load_model, main
from valle.models.lora import LoraConfig, apply_lora, base_fingerprint, has_lora, lora_state_dict
from valle.train.checkpoint import make_payload
from valle.train.finetune import LoraRun

REPO = Path(__file__).resolve().parents[2]
PROMPT_TEXT, TEXT = "the quick brown fox", "jumps over the dog"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A base checkpoint, LoRA adapters trained (here: drawn) on it, a symbol table, a prompt."""
    from valle.data.symbols import SymbolTable
    from valle.data.text import TextTokenizer

    tmp = tmp_path_factory.mktemp("lora-infer")
    symbols = set(TextTokenizer(language="en-us")([f"{PROMPT_TEXT} {TEXT}"])[0])
    table = tmp / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(sorted(symbols)).to_file(table)
    model = tiny_model("valle", 1, share_embedding=False, tie_ar_head=False)
    config = dict(model.hparams, text_tokens=str(table))
    base = tmp / "base.pt"
    torch.save(make_payload(model=model.state_dict(), step=1, epoch=1, train_stage=0,
                            config=config), base)
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets=("attn", "ffn", "embed", "head"))
    sha = base_fingerprint(model.state_dict())
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(5)
    adapters = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in lora_state_dict(model).items()}
    entry = LoraRun(lora, sha, str(base), plan=None).entry()
    path = tmp / "adapters.pt"
    torch.save(make_payload(model=adapters, model_avg=adapters, step=3, epoch=1, train_stage=0,
                            config={"decoder_dim": 1024, "text_tokens": str(table)}) | {"lora": entry},
               path)
    return tmp, base, path


def _greedy(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(4, 20, (2, 9), generator=g)
    prompt = torch.randint(0, 1024, (2, 5, 8), generator=g)
    return model.inference(text, torch.tensor([9, 7]), prompt, torch.tensor([5, 5]),
                           prompt_text_lens=torch.tensor([4, 3]), top_k=1, seed=0, max_len_ratio=2)


def test_merged_checkpoint_decodes_as_base_plus_adapters(files):
    tmp, base, adapters = files
    out = tmp / "merged.pt"
    assert main(["--checkpoint", str(base), "--lora", str(adapters), "--merge-lora", str(out)]) == 0
    unmerged, config = load_model(base, lora=adapters)
    assert has_lora(unmerged) and config["decoder_dim"] == 32  # the base's architecture wins
    merged, merged_config = load_model(out)
    assert not has_lora(merged) and "lora" not in torch.load(out, weights_only=False)
    assert merged_config["text_tokens"] == config["text_tokens"] and merged_config["lora_rank"] == 0
    assert torch.equal(_greedy(unmerged), _greedy(merged))
    # The adapters did change the model: the base alone decodes something else.
    plain, _ = load_model(base)
    assert not torch.equal(_greedy(plain), _greedy(unmerged))


def test_adapters_as_checkpoint_use_their_recorded_base(files):
    _, base, adapters = files
    model, config = load_model(adapters)
    assert has_lora(model) and config["lora_adapters"] == str(adapters)
    reference, _ = load_model(base, lora=adapters)
    assert torch.equal(_greedy(model), _greedy(reference))


def test_adapters_on_another_base_are_refused_naming_both(files):
    tmp, base, adapters = files
    other = tmp / "other.pt"
    payload = torch.load(base, weights_only=False)
    payload["model"]["ar_text_embedding.weight"] = payload["model"]["ar_text_embedding.weight"] + 1.0
    torch.save(payload, other)
    with pytest.raises(InputError, match=f"--lora {adapters}: trained on base {base}.*--checkpoint {other}"):
        load_model(other, lora=adapters)
    with pytest.raises(InputError, match="not LoRA adapters"):
        load_model(base, lora=other)
    with pytest.raises(InputError, match="no adapters to merge"):
        from valle.infer import build_parser, write_merged_lora

        write_merged_lora(build_parser().parse_args(["--checkpoint", str(base), "--merge-lora",
                                                     str(tmp / "x.pt")]))


@pytest.mark.timeout(300)
def test_cli_wavs_with_lora_and_merged_are_equal(files):
    sf = pytest.importorskip("soundfile")
    tmp, base, adapters = files
    prompt = tmp / "prompt.wav"
    sf.write(str(prompt), np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32),
             24000)
    merged = tmp / "cli-merged.pt"
    common = ["--text-prompts", PROMPT_TEXT, "--audio-prompts", str(prompt), "--text", TEXT,
              "--top-k", "1", "--max-len-ratio", "1.0", "--device", "cpu", "--allow-random-encodec"]
    runs = {"lora": ["--checkpoint", str(base), "--lora", str(adapters), "--merge-lora", str(merged)],
            "merged": ["--checkpoint", str(merged)]}
    for name, flags in runs.items():
        proc = subprocess.run([sys.executable, str(REPO / "bin" / "infer.py"), *flags, *common,
                               "--output-dir", str(tmp / name)],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, _ = sf.read(str(tmp / "lora" / "0.wav"))
    b, _ = sf.read(str(tmp / "merged" / "0.wav"))
    assert a.shape == b.shape and np.allclose(a, b, atol=1e-4)
