"""What a failed vote leads to: retry as is, split finer, quarantine a cut, give up.

`Recovery` decides for this rank's batch (through `OomPolicy`) and shares the cuts it
quarantined with every rank (the control channel: no device memory). Giving up is
said in the next vote, so every rank stops together.
"""

from __future__ import annotations

import logging

from valle.train.batching import Batch, batch_size, drop_cuts, select_rows
from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.guard import Failure
from valle.train.resilience.memory import describe_batch
from valle.train.resilience.phases import PhaseTracker
from valle.train.resilience.quarantine import OomPolicy, Quarantine

logger = logging.getLogger(__name__)


class Recovery:
    def __init__(self, policy: OomPolicy, quarantine: Quarantine, channel: ControlChannel,
                 phases: PhaseTracker, rank: int, distributed: bool):
        self.policy = policy
        self.quarantine = quarantine
        self.channel = channel
        self.phases = phases
        self.rank = rank
        self.distributed = distributed
        self.give_up: str | None = None  # why this rank says the GPU is the problem

    def drop_quarantined(self, batch: Batch | None) -> tuple[Batch | None, list[str]]:
        """`batch` without the cuts already quarantined, and their ids."""
        if batch is None or not len(self.quarantine):
            return batch, []
        with self.phases.host_work():
            return drop_cuts(batch, self.quarantine.cut_ids)

    def note_trained(self, batch: Batch) -> None:
        with self.phases.host_work():
            self.policy.note_trained(batch["audio_features_lens"].tolist(),
                                     batch["text_tokens_lens"].tolist())

    def refine(self, step: int, batch: Batch | None, split: int,
               failure: Failure) -> tuple[Batch | None, int, list[str]]:
        """After a local failure: retry, split finer, or quarantine a cut that failed
        alone twice (memory freed in between). Returns (batch, split, quarantined)."""
        if batch is None:
            return None, split, []
        if not failure.cut_ids:
            # Not while this rank's data was in flight: retry as is - unless it keeps
            # happening, which no split can fix (said in the next vote: all stop).
            if self.policy.non_data_failure():
                self.give_up = (f"step {step} failed {self.policy.non_data_failures} times "
                                "outside any batch's forward/backward")
            return batch, split, []
        if len(failure.cut_ids) > 1:
            if self.policy.retry_as_is(split):
                # Memory was freed: a transient failure passes as it is, and the same
                # micro-batches give bit for bit the same gradient (in fp16 too).
                return batch, split, []
            return batch, min(split * 2, batch_size(batch)), []
        cut_id = failure.cut_ids[0]
        if not self.policy.quarantine_now(cut_id):
            return batch, split, []  # one transient failure is not a verdict on the cut
        with self.phases.host_work():
            self._quarantine(step, batch, cut_id, failure)
            batch, _ = drop_cuts(batch, {cut_id})
        return batch, min(split, batch_size(batch)) if batch else 1, [cut_id]

    def _quarantine(self, step: int, batch: Batch, cut_id: str, failure: Failure) -> None:
        info = describe_batch(select_rows(batch, [batch["cut_ids"].index(cut_id)]))
        row = {k: v[0] for k, v in info.items() if v and k != "cut_ids"}
        fitted = self.policy.fitted_before_here(row.get("audio_frame_lens", 0),
                                                row.get("text_token_lens", 0))
        self.quarantine.add(cut_id, reason=f"out of memory in {failure.phase} even alone, "
                            "twice", step=step, rank=self.rank, message=failure.message,
                            fitted_before=fitted, **row)

    def share_quarantine(self, new_ids: list[str]) -> None:
        """Tell every rank about newly quarantined cuts (the sampler may deal the cut
        to another rank next epoch). Runs on every rank after a failed vote only."""
        entries = [self.quarantine.entries[c] for c in new_ids]
        if self.distributed:
            with self.phases.phase_scope("quarantine"):
                gathered = self.channel.gather_objects(entries)
            entries = [e for per_rank in gathered for e in per_rank]
            self.quarantine.merge(entries)
        self.policy.note_quarantined(entries)
        self.give_up = self.policy.verdict()  # said in the next vote, so all stop together

    def give_up_message(self) -> str:
        why = self.give_up or "another rank found it (see its log)"
        return (f"out-of-memory errors are not explained by the data: {why}. The GPU, not the "
                "data, is the problem: another process on the device, a leak, or settings "
                "that no longer fit (check nvidia-smi and <exp-dir>/oom/events-rank*.jsonl). "
                "Cuts quarantined in this run are listed in <exp-dir>/quarantine.jsonl; "
                "remove the lines of healthy cuts before restarting.")
