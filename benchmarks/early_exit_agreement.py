"""Would an early-exit draft pay? How often the embedded model's next token, read after its first N layers (the
final norm and the shared head on that layer's hidden state), equals the token of all 30 layers.

A draft of N layers costs about N/30 of a decode step per guessed token; with k guesses, per-token acceptance a
must give more tokens per step than the guesses cost, (1 - a^(k+1)) / (1 - a) > 1 + k N / 30, which for k = 3
and N = 15 needs a above 0.8. Uses transformers on the embedded GGUF (float32), greedy continuations of chat
prompts.

    .venv/bin/python benchmarks/early_exit_agreement.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serval.model.registry import resolve_model_path  # noqa: E402
from serval.platform_info import describe_hardware  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how photosynthesis works.",
           "What should I pack for a week of hiking?"]
DEPTHS = (6, 10, 15, 20, 25, 28)


def main() -> None:
    import transformers

    print(f"machine: {describe_hardware()}", flush=True)
    path = resolve_model_path(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    agree = {n: [] for n in DEPTHS}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=96, do_sample=False)
            hidden = model(out, output_hidden_states=True).hidden_states
            start = ids.shape[1] - 1
            final = model.lm_head(model.model.norm(hidden[-1]))[0, start:-1].argmax(-1)
            for n in DEPTHS:
                early = model.lm_head(model.model.norm(hidden[n]))[0, start:-1].argmax(-1)
                agree[n] += (early == final).tolist()
    print(f"{'layers':>6} {'agreement with all 30':>22}")
    for n in DEPTHS:
        print(f"{n:>6} {sum(agree[n]) / len(agree[n]):>22.2f}")


if __name__ == "__main__":
    main()
