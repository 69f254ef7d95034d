"""An inference worker that cheats, for the RL fault tests: the real worker process (prime.rl.worker)
with a tamper hook between generation and submission. Never part of a production path.

    python -m prime.testing.rogue_worker --attack answer-swap --token-file T --work-dir D

- answer-swap: replaces each completion of a reverse prompt with the right answer (what a worker would
  do to earn reward it did not sample), rebuilding the proof and logprobs with a prefill of the claimed
  model so that only the tokens themselves are wrong.
- int8: generates with int8-quantized weights and claims the float32 model.
- stall: honest rollouts, each lease held 2 s (a slow worker, for tests that kill one mid-lease).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from prime.inference.engine import Completion, GenerationRequest
from prime.inference.hf_engine import HFEngine
from prime.rl.worker.__main__ import main as worker_main
from prime.rl.policy import CHARACTERS, SPECIALS
from prime.testing.toploc_attacks import int8_weights, prove_by_prefill
from prime.verify.verifier import Claim


def answer_swap(requests: list[GenerationRequest], completions: list[Completion], engine: HFEngine) -> list[Completion]:
    equals = CHARACTERS.index("=")
    forged = []
    for request, completion in zip(requests, completions):
        digits = request.prompt[:request.prompt.index(equals)] if equals in request.prompt else request.prompt
        tokens = (list(reversed(digits)) + [SPECIALS["</s>"]])[:request.sampling.max_tokens]
        claim = Claim(request.prompt, request.seed, request.sampling, completion)
        forged.append(prove_by_prefill(engine.model, claim, tokens, engine.observer))
    return forged


class Int8:
    """Regenerates every request with an int8 copy of the model the engine holds."""

    def __init__(self) -> None:
        self.engines: dict[int, HFEngine] = {}

    def __call__(self, requests, completions, engine: HFEngine) -> list[Completion]:
        if id(engine) not in self.engines:
            self.engines[id(engine)] = HFEngine(int8_weights(engine.model), eos_id=engine.eos_id, pad_id=engine.pad_id,
                                                observer=engine.observer)
        return [replace(c, compute_dtype="float32") for c in self.engines[id(engine)].generate(requests)]


def stall(requests, completions, engine) -> list[Completion]:
    """Honest, but each lease is held 2 s before it is returned: a slow worker, so that a test can kill
    one while it surely holds a lease."""
    time.sleep(2.0)
    return completions


ATTACKS = {"answer-swap": lambda: answer_swap, "int8": Int8, "stall": lambda: stall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.testing.rogue_worker", description=__doc__.split("\n\n")[0],
                                     epilog="Other arguments are the worker's (python -m prime.rl.worker --help).")
    parser.add_argument("--attack", choices=sorted(ATTACKS), required=True)
    args, rest = parser.parse_known_args(argv)
    return worker_main(rest, tamper=ATTACKS[args.attack]())


if __name__ == "__main__":
    sys.exit(main())
