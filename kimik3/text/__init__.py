"""Tokenizers behind one protocol (`Tokenizer`): encode, decode, an incremental detokenizer for
streams, each id's bytes (logprobs), the special ids, and the chat template.

Backends:

* `ByteTokenizer`: the byte-level tokenizer of `kimik3.tokenizer` (ids 0..255 are bytes, the
  special tokens follow): tests and the random-weight demo.
* `BPETokenizer`: a Hugging Face ``tokenizer.json`` (the `tokenizers` library); `train_bpe`
  trains a byte-level BPE on a corpus with the byte tokenizer's first 267 ids (bytes, then the
  special tokens) kept where they are, so every id the engine and the model know (<|eos|>,
  <|image|>, ...) stays valid.
* `TiktokenTokenizer`: a tiktoken-format BPE file (one "base64-token rank" line per token, as
  Kimi ships ``tiktoken.model``), its special tokens after the ranks.

`load_tokenizer(spec)`: "byte", a ``tokenizer.json``, a ``*.tiktoken`` / ``tiktoken.model``
file, or a directory holding one, configured by the files beside it as transformers'
``AutoTokenizer`` reads them (`kimik3.text.load.read_config`: ``tokenizer_config.json``'s
``added_tokens_decoder``, named tokens and ``chat_template``, ``chat_template.jinja``,
``special_tokens_map.json``), the project's ``"roles"`` map where those name nothing.  The chat
template is Jinja (`chat_template`) and gives transformers' ids, except that message contents
never become special tokens, whatever they spell.  A tokenizer without image tokens serves text:
only a conversation with images needs them.
"""

from kimik3.text.base import BaseTokenizer, IncrementalDetokenizer, Tokenizer
from kimik3.text.byte import ByteTokenizer
from kimik3.text.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from kimik3.text.load import holds_tokenizer, load_serving_tokenizer, load_tokenizer

__all__ = [
    "BaseTokenizer",
    "ByteTokenizer",
    "ChatTemplate",
    "DEFAULT_TEMPLATE",
    "IncrementalDetokenizer",
    "Tokenizer",
    "holds_tokenizer",
    "load_serving_tokenizer",
    "load_tokenizer",
]
