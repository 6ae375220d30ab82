"""Plachtaa/VALL-E-X checkpoints load as is and decode as Plachtaa's own ``VALLE.inference``.

The fixture (tests/fixtures/vallex, see PROVENANCE.md) was written once by Plachtaa's code:
a tiny VALL-E X in its exact ``{"model": state_dict}`` file layout (no hyper-parameters) and
what its ``inference`` computed with it, greedily (top_k 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from valle.models import get_model
from valle.models.convert import VALLEX_LANGUAGES, CheckpointError, load_model_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"
CASES = ("en_prompt_zh_text", "zh_prompt_mixed_text")


@pytest.fixture(scope="module")
def reference():
    state, hp = load_model_checkpoint(FIXTURE / "vallex_tiny.pt")
    model = get_model(hp).eval()
    model.load_state_dict(state)  # strict: every key converted, nothing left over
    return model, hp, torch.load(FIXTURE / "expected.pt")


def language_row(hp, prompt_language, text_language, enroll: int, n: int) -> torch.Tensor:
    """Per-token ids from language names, through the table the checkpoint's config records."""
    ids = {lang: i for i, lang in enumerate(hp["languages"])}
    text = [text_language] * (n - enroll) if isinstance(text_language, str) else text_language
    return torch.tensor([[ids[lang] for lang in [prompt_language] * enroll + list(text)]])


def test_hyper_parameters_from_macros_and_shapes(reference):
    _, hp, _ = reference
    assert hp["source_format"] == "vallex" and hp["text_frontend"] == "vallex-bpe"
    # read from the shapes
    assert (hp["decoder_dim"], hp["num_decoder_layers"], hp["num_quantizers"]) == (32, 2, 8)
    assert hp["num_text_tokens"] == 2048 and hp["scale_factor"] == 1.0 and hp["prepend_bos"]
    # macros.py where shapes cannot tell
    assert hp["nhead"] == 16 and hp["prefix_mode"] == 1 and hp["norm_first"]
    assert hp["share_embedding"] and hp["nar_head_tie"] == "lifeiteng" and not hp["tie_ar_head"]
    # the model's own language table (not macros.lang2code, which numbers prompt files)
    assert hp["languages"] == ["en", "zh", "ja"] == list(VALLEX_LANGUAGES)
    assert hp["num_languages"] == 3


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_greedy_synthesis_matches_plachtaa(reference, case, use_kv_cache):
    model, hp, e = reference
    ref = e[case]
    text, enroll = e["text"], e["enroll_x_lens"]
    langs = language_row(hp, ref["prompt_language"], ref["text_language"], enroll, text.shape[1])
    codes = model.inference(text, torch.tensor([text.shape[1]]), e["prompt"],
                            prompt_text_lens=torch.tensor([enroll]), text_languages=langs,
                            top_k=1, use_kv_cache=use_kv_cache)  # fmt: skip
    assert codes.shape == ref["codes"].shape and codes.shape[2] == 8
    assert torch.equal(codes, ref["codes"])


def test_fixture_covers_eos_and_length_cap(reference):
    _, _, e = reference
    n = e["text"].shape[1]
    frames = {case: e[case]["codes"].shape[1] for case in CASES}
    assert frames["en_prompt_zh_text"] < 16 * n  # stopped on EOS
    assert frames["zh_prompt_mixed_text"] == 16 * n  # ran to Plachtaa's cap, 16 x the text


def test_languages_change_the_codes(reference):
    # The language embeddings are used: the same ids in other languages decode otherwise.
    model, hp, e = reference
    text, enroll = e["text"], e["enroll_x_lens"]
    langs = language_row(hp, "en", "en", enroll, text.shape[1])
    codes = model.inference(text, torch.tensor([text.shape[1]]), e["prompt"], text_languages=langs,
                            top_k=1, max_len_ratio=1.0)  # fmt: skip
    assert not torch.equal(codes, e["en_prompt_zh_text"]["codes"][:, : codes.shape[1]])


def test_a_vallex_checkpoint_with_more_language_rows_needs_their_names(tmp_path):
    payload = torch.load(FIXTURE / "vallex_tiny.pt")
    for half in ("ar", "nar"):
        key = f"{half}_language_embedding.word_embeddings.weight"
        payload["model"][key] = torch.cat([payload["model"][key], payload["model"][key][:1]])
    torch.save(payload, tmp_path / "four.pt")
    with pytest.raises(CheckpointError, match="four.pt: a VALL-E X checkpoint with 4 language rows"):
        load_model_checkpoint(tmp_path / "four.pt")
    payload["languages"] = ["en", "zh", "ja", "ko"]
    torch.save(payload, tmp_path / "four.pt")
    _, hp = load_model_checkpoint(tmp_path / "four.pt")
    assert hp["languages"] == ["en", "zh", "ja", "ko"] and hp["num_languages"] == 4


def _hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding Plachta/VALL-E-X's checkpoint (the tiny one), as
    huggingface_hub lays it out: the blob named by its sha256, the snapshot linking to it."""
    import hashlib

    data = (FIXTURE / "vallex_tiny.pt").read_bytes()
    repo, commit = root / "models--Plachta--VALL-E-X", "0" * 40
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "vallex-checkpoint.pt").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.mark.timeout(120)
def test_hub_names_resolve_offline_from_a_prefilled_cache(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    cache = _hub_cache(tmp_path / "hub")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = (
        "from valle.models.convert import load_model_checkpoint, CheckpointError\n"
        "_, hp = load_model_checkpoint('hf:Plachta/VALL-E-X/vallex-checkpoint.pt')\n"
        "print(hp['source_format'], hp['languages'])\n"
        "try:\n"
        "    load_model_checkpoint('hf:Plachta/VALL-E-X/other.pt')\n"
        "except CheckpointError as e:\n"
        "    print(e)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=100, check=True).stdout.splitlines()  # fmt: skip
    assert out[0] == "vallex ['en', 'zh', 'ja']"
    assert out[1].startswith(
        f"checkpoint hf:Plachta/VALL-E-X/other.pt: Plachta/VALL-E-X/other.pt is not in the hub cache {cache}"
    )
    with pytest.raises(CheckpointError, match="hf:OWNER/REPO/FILE"):
        load_model_checkpoint("hf:Plachta/vallex-checkpoint.pt")
