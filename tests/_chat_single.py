"""One conversation as one sample: a view of :func:`eagle3.chat.samples.conversation_samples` for tests."""

from __future__ import annotations

from typing import Optional

from eagle3.chat.samples import conversation_samples
from eagle3.chat.template import ChatOptions, options_or_default
from eagle3.errors import UserError


class TemplateNotPrefixStable(UserError):
    """The conversation does not fit in one sample (or has no consistent rendering at all)."""


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    chat_template: Optional[str] = None,
    too_long: str = "truncate",
    *,
    opts: Optional[ChatOptions] = None,
    tools: Optional[list] = None,
) -> Optional[tuple[list[int], list[int]]]:
    """Single-sample view of :func:`conversation_samples`: ``(input_ids, loss_mask)`` or None.

    Raises:
        TemplateNotPrefixStable: the conversation needs several samples or has no consistent
            rendering. UserError: as :func:`conversation_samples`.
    """
    res = conversation_samples(
        tokenizer, messages, max_length, options_or_default(opts, chat_template), too_long, tools
    )
    if res.skip_reason is not None:
        raise TemplateNotPrefixStable(
            f"verifier.chat_template: the template is not prefix-stable for this "
            f"conversation and it has no consistent rendering ({res.skip_reason})"
        )
    if res.counts["split_conversations"]:
        raise TemplateNotPrefixStable(
            "verifier.chat_template: the template is not prefix-stable for this conversation (its history changes "
            f"as turns are added): it gives {res.counts['split_samples']} samples, one per served context"
        )
    if not res.samples:
        return None
    return res.samples[0].input_ids, res.samples[0].loss_mask
