"""Exports a checkpoint's model to Hugging Face format: safetensors, config.json, generation config and
the tokenizer, so `AutoModelForCausalLM` and `AutoTokenizer.from_pretrained(out)` load it and
`generate` works.

    python -m prime.tools.export runs/cpu-demo/checkpoints/step_00000200 --out exported/cpu-demo
    python -m prime.tools.export runs/demo --outer-step 8 --out exported/demo-step8 --prompt "def "
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch


def bytes_to_unicode() -> dict[int, str]:
    """A printable character for each byte (the GPT-2 byte-level convention HF tokenizers decode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_for_hf(out: Path) -> None:
    """prime's built-in byte tokenizer (bytes 0..255, then BOS 256, EOS 257, PAD 258) as a HF fast tokenizer
    with exactly the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from prime.data.tokenizer import ByteTokenizer

    ours = ByteTokenizer()
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    specials = {"<s>": ours.bos_id, "</s>": ours.eos_id, "<pad>": ours.pad_id}
    vocab.update(specials)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)


def find_outer_step_checkpoint(run_dir: Path, outer_step: int) -> Path:
    """The checkpoint that holds outer step K of a multi-node run: inner step K × H, from any node (the
    nodes' models are identical there; the coordinator checked their hashes)."""
    candidates = sorted(run_dir.glob("*/checkpoints/step_*/trainer.json")) + \
        sorted(run_dir.glob("checkpoints/step_*/trainer.json"))
    available = {}
    for trainer_file in candidates:
        config = json.loads(trainer_file.read_text())["config"]
        step, inner = int(trainer_file.parent.name.split("_")[1]), int(config["diloco"]["inner_steps"])
        if step % inner == 0:
            available.setdefault(step // inner, trainer_file.parent)
    if outer_step not in available:
        have = ", ".join(map(str, sorted(available))) or "none"
        raise FileNotFoundError(
            f"no checkpoint of outer step {outer_step} under {run_dir} (outer steps with one: {have}); nodes write "
            "checkpoints every checkpoint.every inner steps, so set it to a multiple of diloco.inner_steps")
    return available[outer_step]


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    from prime.config import JobConfig
    from prime.core.checkpoint import CheckpointStore
    from prime.core.model import build_model

    checkpoint = Path(checkpoint)
    trainer_file = checkpoint / "trainer.json"
    if not trainer_file.exists():
        raise FileNotFoundError(
            f"{checkpoint} is not a complete prime checkpoint (no trainer.json); pass a step_* directory"
        )
    trainer_state = json.loads(trainer_file.read_text())
    config = JobConfig.model_validate(trainer_state["config"])
    model = build_model(config.model, config.train.seed, "cpu")
    # One process: DCP reassembles the shards that all ranks wrote.
    CheckpointStore.load_model(checkpoint, model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if config.data.tokenizer == "byte":
        byte_tokenizer_for_hf(out)
        from prime.data.tokenizer import ByteTokenizer

        special = ByteTokenizer()
        model.config.bos_token_id, model.config.eos_token_id = special.bos_id, special.eos_id
        model.config.pad_token_id = special.pad_id
    else:
        tokenizer = Path(config.data.tokenizer).expanduser()
        if not tokenizer.exists():
            raise FileNotFoundError(f"the run's tokenizer {config.data.tokenizer} is not on this machine; copy it "
                                    "here (same path) to export it with the model")
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, out, dirs_exist_ok=True)
        else:
            shutil.copy(tokenizer, out / "tokenizer.json")
    model.config.use_cache = True  # training turns it off; generation wants it
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / "prime.json").write_text(json.dumps({"checkpoint": str(checkpoint.resolve()), "step": trainer_state["step"],
                                                "tokens_seen": trainer_state["tokens_seen"],
                                                "tokenizer": config.data.tokenizer}, indent=2))
    return out


def sample(out: Path, prompt: str, new_tokens: int = 60) -> str:
    """Greedy continuation of `prompt` by the exported model, loaded the way a user would load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(generated[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Export a prime checkpoint to Hugging Face format (safetensors + config + tokenizer).",
        epilog="examples:\n  python -m prime.tools.export runs/cpu-demo/checkpoints/step_00000200 --out exported/cpu-demo\n"
               "  python -m prime.tools.export runs/demo --outer-step 8 --out exported/demo --prompt 'def '",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a checkpoint directory (…/checkpoints/step_*), or with --outer-step "
                                                "a multi-node run directory")
    parser.add_argument("--outer-step", type=int, default=None, help="export this committed outer step of the run")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--prompt", default=None, help="after exporting, print the model's continuation of this text")
    args = parser.parse_args(argv)
    try:
        checkpoint = find_outer_step_checkpoint(args.path, args.outer_step) if args.outer_step is not None else args.path
        with torch.no_grad():
            out = export_checkpoint(checkpoint, args.out)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {out}")
    if args.prompt is not None:
        print(f"sample: {sample(out, args.prompt)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
