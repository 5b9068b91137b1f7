"""The tool warm start's demonstrations: scripted episodes played by the environment, loss on the
model's tokens only."""

from __future__ import annotations

import numpy as np

from rljax import envs
from rljax.data.example import Example
from rljax.data.templates import PromptFormat
from rljax.tokenizers.char import CharTokenizer
from rljax.warmstart.tool_use import demonstration_batch


def test_demonstrations_mask_the_environment_and_drop_wrong_episodes():
    """Three products: two demonstrations come out as prompt | call | observation | answer + EOS
    with the loss on exactly the call, the answer and EOS; the one whose reference answer the
    calculator's result does not match is dropped, and so is one over the token budget.

    Catches: observation tokens in the loss, a missing EOS target, demonstrations kept when the
    environment scores them wrong, and episodes longer than the RL budget kept."""
    tok = CharTokenizer("0123456789+-*= <>/.tolresu")
    env = envs.make_env("calculator", max_turns=3, scorer_time_limit_s=None)
    rows = [("12 * 34 =", "408", "12*34"), ("5 * 6 =", "31", "5*6"),  # a wrong reference answer
            ("7 * 8 =", "56", "7*8"), ("123 * 456 =", "56088", "123*456")]  # the last is over budget
    examples = [Example(id=str(i), question=q, answer=a, metadata={"expression": e}) for i, (q, a, e) in enumerate(rows)]
    tokens, attn, loss = demonstration_batch(examples, env, tok, PromptFormat(template="{question}"),
                                             max_prompt_len=16, add_bos=True, max_episode_tokens=44)
    texts = [tok.decode(t[a].tolist(), skip_special=False) for t, a in zip(tokens, attn)]
    assert texts == ["<bos>12 * 34 =<tool>12*34</tool><result>408</result>408<eos>",
                     "<bos>7 * 8 =<tool>7*8</tool><result>56</result>56<eos>"]
    trained = [tok.decode(t[m].tolist(), skip_special=False) for t, m in zip(tokens, loss)]
    assert trained == ["<tool>12*34</tool>408<eos>", "<tool>7*8</tool>56<eos>"]
    assert not np.any(loss & ~attn)
