"""``bin/serve.py``: serve the synthesis page for the checkpoints of an exp dir.

Flags of bin/infer.py that are not the page's own (``--device``, ``--dtype``, ``--max-len-ratio``,
``--nar-decoding``, ``--codec-dir``, ...) are accepted too: they set how every request is decoded,
and the page's decoding fields start from them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

from valle.infer import InputError, decode_options, resolve_vocos, select_checkpoint
from valle.infer import build_parser as build_infer_parser

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="A web page to try a VALL-E checkpoint: prompt, text, decoding options -> wav. "
                    "Any other bin/infer.py flag (e.g. --device, --max-len-ratio) sets how requests "
                    "are decoded.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--exp-dir", type=Path, default=None,
                   help="offer every *.pt checkpoint under this directory (rescanned on page load)")  # fmt: skip
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="a checkpoint to offer besides --exp-dir's (repeatable); the default choice")  # fmt: skip
    p.add_argument("--prompt-dir", type=Path, default=None,
                   help="example prompts: its audio files, each with its transcript in NAME.txt beside it")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where wavs and spectrograms are kept (default: a temporary directory)")  # fmt: skip
    p.add_argument("--keep-results", type=int, default=50, help="results kept for playing/download")
    p.add_argument("--max-models", type=int, default=2, help="checkpoints kept loaded at once")
    g = p.add_argument_group("load", "the queue and batching (docs/inference.md, \"Under load\")")
    g.add_argument("--max-queue", type=_max_queue, default=None, metavar="N|auto",
                   help="requests that may wait; more get a 503 with Retry-After (auto: about a "
                        "minute of work at the measured speed; 64 before the first batch)")  # fmt: skip
    g.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds after which a request is ended, queued or decoding (0: never)")  # fmt: skip
    g.add_argument("--max-batch", type=int, default=16,
                   help="rows (texts) decoded together at most; 1 decodes one request at a time")  # fmt: skip
    g.add_argument("--batch-window", type=float, default=0.01,
                   help="seconds the synthesis thread waits after a request arrives for others to "
                        "batch with it")  # fmt: skip
    return p


def _max_queue(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'auto'), got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(the page's own flags, bin/infer.py's arguments for every request)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if not args.checkpoint and args.exp_dir is None:
        parser.error("give --exp-dir or --checkpoint")
    infer_args = build_infer_parser().parse_args(["--checkpoint", "-", *rest])
    return args, infer_args


def default_checkpoint(args: argparse.Namespace) -> Path | None:
    """The one bin/infer.py would use: the first --checkpoint, else the exp dir's best one."""
    if args.checkpoint:
        return args.checkpoint[0]
    try:
        return select_checkpoint(args.exp_dir) if args.exp_dir.is_dir() else None
    except InputError:
        return None


def create_app_from_args(args: argparse.Namespace, infer_args: argparse.Namespace):
    from valle.serve.app import PageSettings, create_app
    from valle.serve.engine import InferBackend, ResultStore, SynthesisService

    decode_options(infer_args)  # a bad decoding flag fails now, not at the first request
    resolve_vocos(infer_args)
    device = torch.device(infer_args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="valle-serve-"))
    service = SynthesisService(InferBackend(device, args.max_models), infer_args,
                               ResultStore(results_dir / "results", args.keep_results),
                               max_queue=args.max_queue, request_timeout=args.request_timeout or None,
                               window=args.batch_window, max_batch=args.max_batch)  # fmt: skip
    settings = PageSettings(exp_dir=args.exp_dir, checkpoints=list(args.checkpoint),
                            prompt_dir=args.prompt_dir, upload_dir=results_dir / "uploads",
                            default_checkpoint=default_checkpoint(args))  # fmt: skip
    logger.info("device %s; results in %s", device, results_dir)
    return create_app(service, settings)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args, infer_args = parse_args(argv)
    try:
        app = create_app_from_args(args, infer_args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    logger.info("synthesis page: http://%s:%d/", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
