"""Text samples: what the model writes after a fixed prompt, at every evaluation.

The prompt is the validation split's first PROMPT_TOKENS tokens (text the tokenizer can always
encode), or in a dataset of documents with a loss mask the first held-out document's prompt; a
sample of documents ends at the first end of text drawn. The draws come from a generator seeded
by the run's seed alone: two runs of a spec write the same samples, and sampling never touches
the training's random state (an exact resume stays exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROMPT_TOKENS = 32
TEMPERATURE = 0.8  # below 1: fewer of the low-probability draws that make a small model's text noise


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    n_tokens: int,
    context: int,
    generator: torch.Generator,
    stop: int | None = None,
) -> Tensor:
    """Up to ``n_tokens`` token ids drawn one at a time after ``prompt`` (int64 [P]), each from the
    model's next-token distribution over the last ``context`` tokens, ending before the first
    ``stop`` id drawn (a document's end of text). Returns int64 [at most n_tokens] on the CPU."""
    device = next(model.parameters()).device
    tokens = prompt.to(device).view(1, -1)  # [1, P]
    out = []
    for _ in range(n_tokens):
        logits = model(tokens[:, -context:])[0, -1].float()  # [V]
        probs = F.softmax(logits / TEMPERATURE, dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=generator)  # [1]
        if stop is not None and int(nxt) == stop:
            break
        out.append(nxt)
        tokens = torch.cat([tokens, nxt.to(device).view(1, 1)], dim=1)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
