"""Chat templates in Jinja (as Hugging Face tokenizers ship them), rendered so that a message's
content can never become a special token.

The template sees ``messages`` (dicts: role, content, n_images), ``add_generation_prompt``,
``special`` (role -> the special token's name: ``special.user`` is "<|user|>"), ``bos_token``,
``eos_token`` and ``image_block`` (one image's placeholders: start, <|image|> x tokens_per_image,
end).  Rendering puts a private-use sentinel where each content goes; the rendered text is split
at the sentinels, the template's own text is encoded with its special-token names as ids, and
each content as plain text (a user who types "<|eos|>" gets the bytes of "<|eos|>").  So a
template places contents as given: string filters on a content (``| trim``) see the sentinel,
not the text, and change nothing.
"""

from __future__ import annotations

import functools
import re

from kimik3 import tokenizer as byte_level

# The byte tokenizer's layout (`kimik3.tokenizer.apply_chat_template`): <|bos|>, then per message
# <|role|> images content <|end_turn|>, then <|assistant|> when a reply is wanted.
DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ special[m.role] }}{{ image_block * m.n_images }}{{ m.content }}"
    "{{ special.end_turn }}{% endfor %}"
    "{% if add_generation_prompt %}{{ special.assistant }}{% endif %}"
)

_SENTINEL = re.compile("\ue000(\\d+)\ue001")


@functools.cache
def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # sandboxed: a template comes from a checkpoint's tokenizer_config.json, i.e. from whoever made it
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


class ChatTemplate:
    """A tokenizer's chat template (None: `DEFAULT_TEMPLATE`)."""

    def __init__(self, tok, source: str | None = None):
        self.tok, self.source = tok, source or DEFAULT_TEMPLATE
        self._template = _environment().from_string(self.source)

    def render(self, messages, *, tokens_per_image: int = 0, add_generation_prompt: bool = True) -> list[int]:
        tok = self.tok
        contents, ctx_messages = [], []
        for m in messages:
            if m.role not in byte_level.ROLES:
                raise ValueError(f"unknown role {m.role!r}; roles are {byte_level.ROLES}")
            if m.n_images and tokens_per_image <= 0:
                raise ValueError("message has images but tokens_per_image is not set (the config has no ViT?)")
            ctx_messages.append({"role": m.role, "content": f"\ue000{len(contents)}\ue001", "n_images": m.n_images})
            contents.append(m.content)
        names = {role: tok.role_names[role] for role in tok.specials}
        needed = (
            {"bos", "end_turn", "assistant"} | {m.role for m in messages} if self.source == DEFAULT_TEMPLATE else set()
        ) | ({"image_start", "image", "image_end"} if tokens_per_image > 0 else set())
        missing = sorted(needed - set(names))
        if missing:
            raise ValueError(
                f"{tok.name} has no special token for {missing}: give it a chat_template "
                f'(tokenizer_config.json) or name them ("roles")'
            )
        image_block = (
            names["image_start"] + names["image"] * tokens_per_image + names["image_end"]
            if tokens_per_image > 0
            else ""
        )
        text = self._template.render(
            messages=ctx_messages,
            add_generation_prompt=add_generation_prompt,
            special=names,
            bos_token=names.get("bos", ""),
            eos_token=names["eos"],
            image_block=image_block,
        )
        ids, at = [], 0
        for match in _SENTINEL.finditer(text):
            ids += tok.encode_with_specials(text[at : match.start()])
            ids += tok.encode(contents[int(match.group(1))])
            at = match.end()
        return ids + tok.encode_with_specials(text[at:])
