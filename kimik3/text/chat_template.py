"""Chat templates in Jinja (as Hugging Face tokenizers ship them), rendered as transformers'
``apply_chat_template`` renders them, except that a message's content can never become a
special token.

The template sees what transformers gives it: ``messages`` (dicts: role, content, and here
n_images), ``add_generation_prompt``, ``tools`` and ``documents`` (None), the tokenizer's named
special tokens (``bos_token``, ``eos_token``, ``pad_token``, ...: `BaseTokenizer.token_names`),
``raise_exception``, ``strftime_now``, transformers' ``tojson``, loop controls and
``{% generation %}``; and this project's ``special`` (role -> the special token's name:
``special.user`` is "<|user|>") and ``image_block`` (one image's placeholders: start, <|image|> x
tokens_per_image, end).

The rendered text is tokenized as transformers tokenizes it (``add_special_tokens=False``: every
special token's name in it is that token's id), so a conversation gives transformers' ids,
except where a content spells a special token's name: before rendering each such name in a
content is replaced by a private-use reference, and after it the referenced text is encoded as
plain text (a user who types "<|eos|>" gets the tokens of the text "<|eos|>").
"""

from __future__ import annotations

import datetime
import functools
import json
import re

from kimik3 import tokenizer as byte_level
from kimik3.text.specials import ROLES_OF_SPECIALS

# The byte tokenizer's layout (`kimik3.tokenizer.apply_chat_template`): <|bos|>, then per message
# <|role|> images content <|end_turn|>, then <|assistant|> when a reply is wanted.
DEFAULT_TEMPLATE = (
    "{{ special.bos }}"
    "{% for m in messages %}{{ special[m.role] }}{{ image_block * m.n_images }}{{ m.content }}"
    "{{ special.end_turn }}{% endfor %}"
    "{% if add_generation_prompt %}{{ special.assistant }}{% endif %}"
)
IMAGE_ROLES = ("image_start", "image", "image_end")

# a content's literal text: "\ue000" index "\ue001" (the index into the render's literals)
_START, _END = "\ue000", "\ue001"
_REFERENCE = re.compile(f"{_START}(\\d+){_END}")


class ChatTemplateError(ValueError):
    """A template's ``raise_exception(message)``: the conversation is one the template refuses
    (roles that do not alternate, ...); a ValueError, so a server answers it with a 400."""


@functools.cache
def _environment():
    # jinja2 (~0.1 s) loads where a template first renders: kimik3.text imports light
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's
        tokens there): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise ChatTemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # sandboxed: a template comes from a checkpoint's tokenizer_config.json, i.e. from whoever made it;
    # otherwise transformers' environment (no keep_trailing_newline: a template's last newline goes)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A tokenizer's chat template (None: `DEFAULT_TEMPLATE`)."""

    def __init__(self, tok, source: str | None = None):
        self.tok, self.source = tok, source or DEFAULT_TEMPLATE
        self._template = _environment().from_string(self.source)
        names = sorted(tok.special_names, key=len, reverse=True)
        # what a content may not spell unmarked: special names, and the reference's own characters
        self._literal = re.compile("|".join([re.escape(n) for n in names] + [_START, _END]))

    def _mark(self, content: str, literals: list[str]) -> str:
        def ref(m):
            literals.append(m.group(0))
            return f"{_START}{len(literals) - 1}{_END}"

        return self._literal.sub(ref, content)

    def render(self, messages, *, tokens_per_image: int = 0, add_generation_prompt: bool = True) -> list[int]:
        """Ids of `messages` (`kimik3.tokenizer.Message`s).  ValueError: an unknown role, images
        without `tokens_per_image`, images where the tokenizer has no image tokens, a template that
        places other than every image's placeholders, the template's own ``raise_exception``
        (`ChatTemplateError`), or (the default template) a role the tokenizer has no special
        token for."""
        tok = self.tok
        literals: list[str] = []
        ctx_messages = []
        n_images = 0
        for m in messages:
            if m.role not in byte_level.ROLES:
                raise ValueError(f"unknown role {m.role!r}; roles are {byte_level.ROLES}")
            if m.n_images and tokens_per_image <= 0:
                raise ValueError("message has images but tokens_per_image is not set (the config has no ViT?)")
            n_images += m.n_images
            ctx_messages.append({"role": m.role, "content": self._mark(m.content, literals), "n_images": m.n_images})
        names = {role: tok.role_names[role] for role in tok.specials}
        if n_images:
            self._check_image_tokens(names)
        if self.source == DEFAULT_TEMPLATE:
            missing = sorted(({"bos", "end_turn", "assistant"} | {m.role for m in messages}) - set(names))
            if missing:
                raise ValueError(
                    f"{tok.name} has no special token for {missing}: give it a chat_template "
                    f'(tokenizer_config.json) or name them ("roles")'
                )
        image_block = names["image_start"] + names["image"] * tokens_per_image + names["image_end"] if n_images else ""
        text = self._template.render(
            **tok.token_names,
            messages=ctx_messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            special=names,
            image_block=image_block,
        )
        ids, at = [], 0
        for match in _REFERENCE.finditer(text):
            k = int(match.group(1))
            if k >= len(literals):  # not a reference this render made: the template's own text
                continue
            ids += tok.encode_with_specials(text[at : match.start()])
            ids += tok.encode(literals[k])
            at = match.end()
        ids += tok.encode_with_specials(text[at:])
        if n_images and ids.count(tok.image_id) != n_images * tokens_per_image:
            raise ValueError(
                f"the chat template of {tok.name} placed {ids.count(tok.image_id)} image placeholders; the "
                f"conversation's {n_images} images need {n_images * tokens_per_image} (it must write "
                "image_block once per image: messages[i].n_images)"
            )
        return ids

    def _check_image_tokens(self, names: dict[str, str]) -> None:
        tok = self.tok
        missing = [r for r in IMAGE_ROLES if r not in names]
        if missing:
            raise ValueError(
                f"the tokenizer {tok.name} has no image token "
                + ", ".join(repr(self.tok.role_names[r]) for r in missing)
                + ": it serves text only (image inputs need its image tokens, by default "
                + ", ".join(repr(ROLES_OF_SPECIALS[r]) for r in IMAGE_ROLES)
                + ', or named in tokenizer_config.json\'s "roles")'
            )
        if tok.image_id != byte_level.IMAGE_ID:
            raise ValueError(
                f"the tokenizer {tok.name} has its image token {names['image']!r} at id {tok.image_id}; the "
                f"model places image embeddings at id {byte_level.IMAGE_ID}"
            )
