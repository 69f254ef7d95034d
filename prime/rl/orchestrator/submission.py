"""What a worker's submission holds, type-checked before anything else looks at it: token ids, finite
logprobs, a finish reason, a base64 proof. Whether the rollout is true is the verifier's to judge."""

from __future__ import annotations

import base64
import binascii
import math

from prime.inference.engine import Completion

# What a malformed submission raises here (or in reading its fields): its worker is evicted.
MALFORMED = (KeyError, TypeError, ValueError, binascii.Error)


def completion_from_wire(entry: dict) -> Completion:
    """A worker's completion, type-checked (what it claims is for the verifier to judge)."""
    tokens, logprobs = entry["tokens"], entry["logprobs"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("tokens must be a list of integers")
    if not isinstance(logprobs, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
        raise ValueError("logprobs must be a list of numbers")
    if not all(math.isfinite(x) for x in logprobs):
        raise ValueError("logprobs must be finite")
    finish = entry["finish_reason"]
    if finish not in ("eos", "length"):
        raise ValueError(f"finish_reason {str(finish)[:20]!r} is neither eos nor length")
    proof = base64.b64decode(str(entry["proof"]), validate=True)
    return Completion(tokens=tokens, logprobs=[float(x) for x in logprobs], finish_reason=finish, proof=proof,
                      compute_dtype=str(entry.get("compute_dtype", "float32"))[:16])
