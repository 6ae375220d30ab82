"""The codec equality checks' shared inputs, and the committed fixtures they are checked
against where the reference packages (``encodec``, ``vocos``: the ``ref`` extra) are absent.

Seeded weights are made by ``fill_seeded``: every floating parameter (in key order) drawn
from one generator, so the reference package's model and ours get the same weights from
the same keys without either's initialisation. The fixtures were written by the packages
themselves (encodec 0.1.1, vocos 0.1.0 on torch 2.9.1):

    PYTHONPATH=$PWD python -m tests.support.codec_reference   # needs the ref extra

which rewrites tests/fixtures/codec/*.json. Rewriting them is only right when the reference
changed on purpose: the files are what proves that codes stay compatible.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "codec"
ENCODEC_FIXTURE = FIXTURES / "encodec_reference.json"
VOCOS_FIXTURE = FIXTURES / "vocos_reference.json"
SEED = 1234
AUDIO_HEAD = 600  # decoded samples stored (the start of the waveform, whole float32 values)


def signal(seconds: float, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """(batch, 1, N) speech-like test audio: a gliding tone, noise and a loudness envelope."""
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * 24000)
    t = torch.arange(n) / 24000
    tone = torch.sin(2 * torch.pi * (180 + 60 * torch.rand(batch, 1, generator=g)) * t * (1 + t))
    env = torch.rand(batch, int(seconds * 20) + 1, generator=g).repeat_interleave(1200, dim=1)[:, :n]
    return (env * (0.3 * tone + 0.05 * torch.randn(batch, n, generator=g))).unsqueeze(1)


def _value(key: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g)
    if key.endswith(("norm.weight", "scale.weight")):  # layer norms, AdaLN scales: around 1
        return 1.0 + 0.1 * x
    if key.endswith("gamma"):  # ConvNeXt layer scale
        return 0.1 + 0.01 * x
    if key.endswith(("embed", "codebook_weights")):  # codebook vectors
        return x
    if key.endswith("weight_g"):
        return 1.0 + 0.1 * x.abs()
    return 0.05 * x


@torch.no_grad()
def fill_seeded(model: torch.nn.Module | dict, seed: int = SEED, skip: tuple[str, ...] = ("window",)) -> None:
    """Every floating tensor of the state dict (or of a dict of a model's tensors, by the
    names the reference gives them) but ``skip`` (the ISTFT window) from one seeded
    generator, in sorted key order; codebooks ``inited``."""
    g = torch.Generator().manual_seed(seed)
    state = model if isinstance(model, dict) else model.state_dict()
    for key in sorted(state):
        t = state[key]
        if key.endswith(skip) or not t.is_floating_point():
            continue
        if key.endswith(("cluster_size", "embed_avg")):
            continue
        t.copy_(1.0 if key.endswith("inited") else _value(key, t.shape, g))


# --- reference models, built by the packages (imported here only) ----------------------------

def encodec_package_model(seed: int = SEED):
    """encodec 0.1.1's 24 kHz model with seeded weights."""
    import warnings

    from encodec import EncodecModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = EncodecModel._get_model([1.5, 3.0, 6.0, 12.0, 24.0], 24000, 1, causal=True,
                                        model_norm="weight_norm", audio_normalize=False, name="encodec_24khz")
    fill_seeded(model, seed)
    return model.eval()


def encodec_package_codes(model, wav: torch.Tensor, kbps: float) -> torch.Tensor:
    model.set_target_bandwidth(kbps)
    with torch.inference_mode():
        return torch.cat([c for c, _ in model.encode(wav)], dim=-1)


def encodec_package_decode(model, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.decode([(codes, None)])


def vocos_package_model(seed: int = SEED):
    """vocos 0.1.0's charactr/vocos-encodec-24khz architecture with seeded weights (its EnCodec
    built offline: only its codebooks matter, and those are in the state dict)."""
    import encodec
    from vocos import Vocos
    from vocos.feature_extractors import EncodecFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    build = encodec.EncodecModel.encodec_model_24khz
    encodec.EncodecModel.encodec_model_24khz = staticmethod(lambda pretrained=True, **kw: build(pretrained=False, **kw))
    try:
        model = Vocos(
            feature_extractor=EncodecFeatures("encodec_24khz", bandwidths=[1.5, 3.0, 6.0, 12.0]),
            backbone=VocosBackbone(input_channels=128, dim=384, intermediate_dim=1152, num_layers=8,
                                   adanorm_num_embeddings=4),
            head=ISTFTHead(dim=384, n_fft=1280, hop_length=320, padding="same"))
    finally:
        encodec.EncodecModel.encodec_model_24khz = build
    fill_seeded(vocos_published_state(model), seed)
    return model.eval()


def vocos_published_state(model) -> dict:
    """What the hub's pytorch_model.bin holds: no EnCodec inside the feature extractor."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("feature_extractor.encodec.")}


def vocos_package_decode(model, codes_tq: torch.Tensor) -> torch.Tensor:
    """(T, Q) codes -> (N,) audio the way vocos decodes EnCodec codes."""
    bandwidth_id = {2: 0, 4: 1, 8: 2, 16: 3}[codes_tq.shape[1]]
    with torch.inference_mode():
        features = model.codes_to_features(codes_tq.T)
        return model.decode(features, bandwidth_id=torch.tensor([bandwidth_id])).reshape(-1)


def fixture_codes(seed: int = SEED, frames: int = 40, q: int = 8) -> torch.Tensor:
    return torch.randint(0, 1024, (frames, q), generator=torch.Generator().manual_seed(seed))


def write_fixtures() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    # EnCodec: seeded weights, a 1.3 s clip, codes at every bandwidth, decoded audio's head.
    model = encodec_package_model()
    wav = signal(1.3, seed=SEED)
    codes = {str(kbps): encodec_package_codes(model, wav, kbps)[0].tolist() for kbps in (1.5, 6.0, 24.0)}
    audio = encodec_package_decode(model, torch.tensor(codes["6.0"]).unsqueeze(0)).reshape(-1)
    keys = {k: list(v.shape) for k, v in model.state_dict().items()}
    ENCODEC_FIXTURE.write_text(json.dumps({
        "made_by": "encodec 0.1.1 on torch " + torch.__version__.split("+")[0],
        "weights_seed": SEED, "signal": {"seconds": 1.3, "seed": SEED}, "codes": codes,
        "audio_head_6.0": audio[:AUDIO_HEAD].tolist(), "audio_abs_mean_6.0": audio.abs().mean().item(),
        "state_dict_shapes": keys}, separators=(",", ":")) + "\n")
    # Vocos: seeded weights, seeded codes at 8 codebooks.
    vocos = vocos_package_model()
    audio = vocos_package_decode(vocos, fixture_codes())
    VOCOS_FIXTURE.write_text(json.dumps({
        "made_by": "vocos 0.1.0 on torch " + torch.__version__.split("+")[0],
        "weights_seed": SEED, "codes_seed": SEED, "frames": 40, "codebooks": 8,
        "audio_head": audio[:AUDIO_HEAD].tolist(), "audio_abs_mean": audio.abs().mean().item(),
        "num_samples": audio.numel(),
        "state_dict_shapes": {k: list(v.shape) for k, v in vocos_published_state(vocos).items()}},
        separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write_fixtures()
    print("wrote", ENCODEC_FIXTURE, VOCOS_FIXTURE)
