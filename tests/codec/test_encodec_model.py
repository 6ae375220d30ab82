"""valle's own EnCodec 24 kHz equals the encodec package: the checkpoint's keys load as is,
codes bit-equal at every bandwidth, decoded audio within float rounding. Where the package
imports (the ``ref`` extra) against it directly; everywhere against the committed fixtures it
wrote (tests/support/codec_reference.py), so the check also runs on torches without it."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support import codec_reference as ref
from valle.codec.encodec import AudioTokenizer, EncodecWeightsError
from valle.codec.encodec_model import BANDWIDTHS, EncodecNet, codebooks_for_bandwidth

FIXTURE = json.loads(ref.ENCODEC_FIXTURE.read_text())
RANDOM_TOKENIZER = json.loads((ref.FIXTURES / "encodec_random_tokenizer.json").read_text())


def _seeded_net() -> EncodecNet:
    net = EncodecNet()
    ref.fill_seeded(net)
    return net.eval()


@pytest.mark.smoke
def test_state_dict_is_the_official_checkpoints():
    """encodec_24khz-d7cc33bc.th's keys and shapes (the package's model, recorded)."""
    ours = {k: list(v.shape) for k, v in EncodecNet().state_dict().items()}
    assert ours == FIXTURE["state_dict_shapes"]
    assert len(ours) == 252


def test_bandwidths_give_the_package_codebook_counts():
    assert [codebooks_for_bandwidth(b) for b in BANDWIDTHS] == [2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="no 7.0 kbps"):
        codebooks_for_bandwidth(7.0)


@pytest.mark.smoke
def test_codes_and_audio_equal_the_packages_recorded_output():
    """Runs everywhere: the codes the package wrote for these seeded weights and this input."""
    net = _seeded_net()
    wav = ref.signal(FIXTURE["signal"]["seconds"], seed=FIXTURE["signal"]["seed"])
    with torch.inference_mode():
        for kbps, expected in FIXTURE["codes"].items():
            net.set_bandwidth(float(kbps))
            assert net.encode(wav)[0].tolist() == expected, f"{kbps} kbps"
        net.set_bandwidth(6.0)
        net.fold_weight_norm()
        assert net.encode(wav)[0].tolist() == FIXTURE["codes"]["6.0"]  # folded weights: same codes
        audio = net.decode(torch.tensor([FIXTURE["codes"]["6.0"]])).reshape(-1)
    head = torch.tensor(FIXTURE["audio_head_6.0"])
    torch.testing.assert_close(audio[: head.numel()], head, rtol=1e-4, atol=1e-5 * head.abs().max().item())
    assert audio.abs().mean().item() == pytest.approx(FIXTURE["audio_abs_mean_6.0"], rel=1e-4)


@pytest.mark.smoke
def test_random_tokenizer_codes_are_those_of_the_tokenizer_before_the_rewrite():
    """--allow-random-encodec corpora (the tiny recipe, the tests) keep their codes: the seeded
    random model and its calibrated codebooks are drawn as before."""
    tok = AudioTokenizer(**RANDOM_TOKENIZER["tokenizer"], download=False)
    for case in RANDOM_TOKENIZER["cases"]:
        wav = ref.signal(case["seconds"], seed=case["signal_seed"], batch=case["batch"])
        assert tok.encode(wav).tolist() == case["codes"], case["seconds"]


@pytest.mark.smoke
def test_no_torchaudio_or_encodec_import():
    """Encoding and decoding import neither torchaudio nor encodec (a fresh interpreter)."""
    import subprocess

    code = ("import sys, torch; from valle.codec.encodec import AudioTokenizer; "
            "t = AudioTokenizer(allow_random_weights=True, download=False); "
            "t.decode(t.encode(torch.zeros(1, 1, 3200))); import valle.codec.vocos, valle.codec.mel, "
            "valle.codec.audio; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchaudio', 'encodec', 'vocos')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_saved_state_dict_loads_and_a_wrong_one_is_named(tmp_path):
    net = _seeded_net()
    good = tmp_path / "encodec_24khz-d7cc33bc.th"
    torch.save(net.state_dict(), good)
    tok = AudioTokenizer(checkpoint=good)
    wav = ref.signal(0.5, seed=3)
    with torch.inference_mode():
        assert torch.equal(tok.encode(wav), net.encode(wav))
    bad = tmp_path / "other.th"
    torch.save({"encoder.model.0.conv.conv.weight_g": torch.zeros(1)}, bad)
    with pytest.raises(EncodecWeightsError, match="other.th: not an EnCodec 24 kHz state dict"):
        AudioTokenizer(checkpoint=bad)


# --- against the package itself (the ref extra) ----------------------------------------------

@pytest.fixture(scope="module")
def package_model():
    pytest.importorskip("encodec", reason="the encodec package (pip install .[ref]) is the reference")
    return ref.encodec_package_model()


@pytest.mark.parametrize("kbps", BANDWIDTHS)
def test_codes_bit_equal_the_package_at_every_bandwidth(package_model, kbps):
    net = _seeded_net()
    net.set_bandwidth(kbps)
    wav = torch.cat([ref.signal(0.9, seed=5), 0.01 * ref.signal(0.9, seed=6)])  # a batch, one quiet
    expected = ref.encodec_package_codes(package_model, wav, kbps)
    with torch.inference_mode():
        got = net.encode(wav)
        assert torch.equal(got, expected)
        audio = net.decode(got)
    expected_audio = ref.encodec_package_decode(package_model, expected)
    torch.testing.assert_close(audio, expected_audio, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("samples", [1, 7, 319, 320, 321, 4801])
def test_short_and_odd_lengths_equal_the_package(package_model, samples):
    """Reflect padding of inputs shorter than the padding (the package's zero-extension)."""
    net = _seeded_net()
    wav = ref.signal(1.0, seed=samples)[..., :samples]
    with torch.inference_mode():
        assert torch.equal(net.encode(wav), ref.encodec_package_codes(package_model, wav, 6.0))


def test_seeded_random_init_is_the_packages(package_model):
    """The same seed, the same initial weights (what --allow-random-encodec relies on)."""
    import warnings

    from encodec import EncodecModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(11)
        theirs = EncodecModel._get_model([1.5, 3.0, 6.0, 12.0, 24.0], 24000, 1, causal=True,
                                         model_norm="weight_norm", audio_normalize=False).state_dict()
    torch.manual_seed(11)
    ours = EncodecNet().state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_packages_checkpoint_loads_through_the_tokenizer(package_model, tmp_path):
    path = tmp_path / "encodec_24khz-d7cc33bc.th"
    torch.save(package_model.state_dict(), path)
    wav = ref.signal(0.7, seed=9)
    assert torch.equal(AudioTokenizer(checkpoint=path).encode(wav), ref.encodec_package_codes(package_model, wav, 6.0))
