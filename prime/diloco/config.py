"""Configuration of DiLoCo's outer loop (used once a run has more than one node)."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic_mesh import SparseCodec

log = logging.getLogger(__name__)


class SparseCompression(BaseModel):
    """diloco.compression = sparse: what each node sends of its pseudo-gradient (SparseLoCo's scheme; see
    elastic_mesh/wire/sparse.py and prime/diloco/error_feedback.py)."""

    model_config = ConfigDict(extra="forbid")

    chunk: int = Field(4096, ge=2, le=1 << 20, description="Values per top-k selection.")
    k: int = Field(64, ge=1, description="Values kept per chunk (64 of 4096: 1.56 %).")
    value_bits: int = Field(2, ge=1, le=4, description="Bits per kept value: its sign and 2^(bits-1) magnitude "
                                                       "levels (bf16, one set per chunk).")
    index_packing: Literal["rice", "fixed"] = Field(
        "rice", description="rice: gaps between sorted indices, Rice-coded (~7.4 bits an index at 64 of 4096). "
                            "fixed: log2(chunk) bits each (12 at 4096, two per 3 bytes: SparseLoCo's).")
    error_decay: float = Field(0.95, ge=0, le=1, description="The residual (what was not sent) is added to the "
                                                             "next pseudo-gradient × this; 0: no error feedback.")

    @model_validator(mode="after")
    def _makes_a_codec(self) -> "SparseCompression":
        try:
            self.codec()
        except ValueError as e:
            raise ValueError(f"diloco.sparse: {e}") from None
        return self

    def codec(self) -> SparseCodec:
        return SparseCodec(self.chunk, self.k, self.value_bits, self.index_packing)


class DilocoConfig(BaseModel):
    """Outer loop: every `inner_steps` steps, nodes average pseudo-gradients and take an outer step."""

    model_config = ConfigDict(extra="forbid")

    inner_steps: int = Field(50, gt=0, description="H: inner AdamW steps between outer steps.")
    mode: Literal["blocking", "delayed", "streaming"] = Field(
        "blocking", description="blocking: the inner steps wait for each outer step. delayed: the outer step of "
                                "round k is decided in the background while round k+1 runs and applied one round "
                                "late (or `overlap_steps` late), keeping the local progress made meanwhile. "
                                "streaming: the model is cut into "
                                "`fragments`, synchronised one after another every H/fragments steps, each in the "
                                "background for `overlap_steps` (see README).")
    fragments: int = Field(5, ge=1, le=64, description="streaming: fragments of the model (consecutive layers, "
                                                       "the largest as small as whole parameters allow); one is "
                                                       "synchronised every H/fragments steps.")
    overlap_steps: int = Field(0, ge=0, description="Inner steps an outer step runs in the background before it "
                                                    "is applied. delayed: 0 is H (one round late); less applies "
                                                    "the average sooner, so it must move within fewer steps. "
                                                    "streaming: 0 is H/fragments; up to H: over H/fragments, "
                                                    "several fragments are in flight at once, decided one after "
                                                    "another (see README).")
    pace: float = Field(0.0, ge=0, le=1, description="delayed/streaming: spread an outer step's all-reduce over "
                                                     "this fraction of the inner steps between launches (H/F "
                                                     "for streaming; τ if shorter), timed, so the link never "
                                                     "sees a burst at its full rate; 0 sends at the link's "
                                                     "rate. A transfer behind its plan uses the rest of τ as "
                                                     "slack before it speeds up; too close to 1 and a slow "
                                                     "step makes the inner steps wait.")
    apply_early: bool = Field(False, description="delayed/streaming: apply an outer step as soon as it is decided "
                                                 "(at the next inner step), τ (overlap_steps) being then the "
                                                 "latest: the average lands fewer steps late where the link is "
                                                 "fast enough, but at an inner step that depends on the network, "
                                                 "so a run is no longer bit-reproducible.")
    eager: Literal["off", "own", "mixed"] = Field(
        "off", description="delayed/streaming: what a node resumes from while an outer step is in flight. off: where "
                           "it stands. own: an outer step taken with its own pseudo-gradient in place of the average. "
                           "mixed: an outer step taken with an estimate of the average, its own fresh "
                           "pseudo-gradient for its share and the others' from the last step for theirs (the eager "
                           "update of Kale et al. 2025; one more fp32 copy of the model per rank). The average, "
                           "once decided, replaces the estimate: the outer state stays the same on every node.")
    inner_optimizer: Literal["keep", "reset"] = Field(
        "keep", description="blocking: what becomes of the inner AdamW state (moments and step count) at an outer "
                            "step. keep: it goes on across rounds. reset: it starts afresh every round (moments "
                            "zero, bias correction from step 0); the learning-rate schedule is unaffected.")
    outer_lr: float = Field(0.7, gt=0, description="Outer Nesterov SGD learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum.")
    compression: Literal["int8", "bf16", "none", "sparse"] = Field(
        "int8", description="Wire format of the pseudo-gradients (accumulation is always fp32). int8, bf16, none: "
                            "dense, summed on the way (scatter, then gather). sparse: the top-k of every chunk in "
                            "a few bits with error feedback (diloco.sparse), gathered whole by every node.")
    sparse: SparseCompression = Field(default_factory=SparseCompression,
                                      description="diloco.compression = sparse: its settings.")
    outlier_factor: float = Field(
        10.0, gt=1, description="A pseudo-gradient whose norm is over this × the others' median is refused."
    )
    serve_snapshots: bool = Field(
        True, description="Serve a snapshot of every committed outer step (and the update that made it) to peers "
                          "that catch up; off, this node cannot help a joiner.")
    catch_up_timeout_s: float = Field(
        600.0, gt=0, description="A node that is behind keeps trying to catch up from its peers this long before it "
                                 "stops with an error (no live node holds the run's newest step).")
    take_peer_moments: bool = Field(
        False, description="A node that fetches a whole snapshot (a joiner) also takes its peers' AdamW moments "
                           "(as many bytes again, chunks from all sources, while the round in flight runs) instead "
                           "of starting AdamW afresh (its own bias correction from step 0). Off: in launch/bench/"
                           "join.py (3 sources, 20 Mbit/s) peers' moments made joiners contribute 2 rounds later "
                           "(60 s against 31 s) and their loss 3-7% further above the others' than the sources "
                           "differ among themselves; fresh moments stayed inside that spread.")
    linger_s: float = Field(
        60.0, ge=0, description="After its last step a node keeps serving this long while a peer is still "
                                "catching up (a straggler that missed the final outer step).")

    @field_validator("eager", mode="before")
    @classmethod
    def _eager_from_bool(cls, value: object) -> object:
        """`eager = true` (a bool before "mixed" existed) means "own" for this release, with a warning."""
        if isinstance(value, bool) or value in ("true", "false"):
            new = "own" if value in (True, "true") else "off"
            log.warning("diloco.eager = %s is the old spelling and goes in the next release: write "
                        "diloco.eager = \"%s\"", str(value).lower(), new)
            return new
        return value

    @model_validator(mode="after")
    def _overlap_fits(self) -> "DilocoConfig":
        if self.mode == "streaming" and self.inner_steps % self.fragments:
            raise ValueError(f"diloco.inner_steps {self.inner_steps} is not a multiple of diloco.fragments "
                             f"{self.fragments}: one fragment is synchronised every H/fragments steps")
        if self.mode != "blocking" and self.overlap_steps > self.inner_steps:
            raise ValueError(f"diloco.overlap_steps {self.overlap_steps} is over diloco.inner_steps "
                             f"{self.inner_steps}: an outer step must be applied before the same "
                             "part of the model is synchronised again")
        if self.inner_optimizer == "reset" and self.mode != "blocking":
            raise ValueError("diloco.inner_optimizer reset is for the blocking mode only: in delayed and streaming "
                             "modes the inner steps run on while an outer step is in flight, so there is no "
                             "moment between rounds to reset at")
        return self

    @property
    def wire_format(self) -> str:
        """The codec's name on the wire (elastic_mesh's codec_for): the compression, or the sparse codec's
        full name, which carries its settings."""
        return self.sparse.codec().name if self.compression == "sparse" else self.compression

    @property
    def fragment_count(self) -> int:
        return self.fragments if self.mode == "streaming" else 1

    @property
    def sync_period(self) -> int:
        """Inner steps between outer steps (a streaming outer step synchronises one fragment)."""
        return self.inner_steps // self.fragment_count

    @property
    def overlap(self) -> int:
        """Inner steps an outer step runs in the background (0: blocking)."""
        if self.mode == "blocking":
            return 0
        return self.overlap_steps or self.sync_period

