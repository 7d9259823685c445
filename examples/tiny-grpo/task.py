"""The learning problem: reverse a short string of digits.

A prompt is a digit string followed by `>`; the correct response is the same digits in reverse
order followed by an end-of-sequence token:

    prompt    3 1 4 >        (left-padded to a fixed width with PAD)
    response  4 1 3 <eos>

The reward is computed by a rule, not a learned model ("verifiable"), and gives partial credit so
that a randomly initialised policy already sees a signal: the fraction of target positions it got
right, divided by the longer of the two lengths so that rambling past the answer costs reward.
Only the exact answer scores 1.0. Everything here is deterministic given a seed.
"""

import torch

# Vocabulary: three special tokens, then the ten digits.
PAD, SEP, EOS = 0, 1, 2
DIGIT0 = 3
VOCAB_SIZE = DIGIT0 + 10

MIN_DIGITS = 2
MAX_DIGITS = 5

# Every prompt has the same width: the longest digit string plus SEP. Shorter strings are
# left-padded so that all prompts of a batch end at the same position and generation can run on
# the whole batch at once. The model simply sees PAD as a token (there is no attention mask).
PROMPT_LEN = MAX_DIGITS + 1
# Room for the longest answer plus its EOS; a response that has not ended by then is cut off.
MAX_RESPONSE_LEN = MAX_DIGITS + 1
MAX_SEQ_LEN = PROMPT_LEN + MAX_RESPONSE_LEN


def make_prompts(n: int, seed: int) -> torch.Tensor:
    """`n` prompts as a [n, PROMPT_LEN] int64 tensor, a pure function of `seed`."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MIN_DIGITS, MAX_DIGITS + 1, (n,), generator=g)
    digits = torch.randint(0, 10, (n, MAX_DIGITS), generator=g)
    prompts = torch.full((n, PROMPT_LEN), PAD, dtype=torch.long)
    for i in range(n):
        k = int(lengths[i])
        prompts[i, MAX_DIGITS - k : MAX_DIGITS] = DIGIT0 + digits[i, :k]
    prompts[:, -1] = SEP
    return prompts


def answer(prompt: list[int]) -> list[int]:
    """The correct response tokens (without EOS) for one prompt."""
    digits = [t for t in prompt if t >= DIGIT0]
    return digits[::-1]


def reward(prompt: list[int], response: list[int]) -> float:
    """Score one response (its tokens, EOS and anything after it excluded) against the rule."""
    target = answer(prompt)
    matches = sum(1 for a, b in zip(response, target) if a == b)
    return matches / max(len(response), len(target))


def decode(tokens: list[int]) -> str:
    """Human-readable form of a token list, for logs."""
    names = {PAD: "_", SEP: ">", EOS: "$"}
    return "".join(names.get(t, str(t - DIGIT0)) for t in tokens)
