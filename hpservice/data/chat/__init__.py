"""Chat data: conversations a user already has, rendered with their model's chat template.

    tok = load_chat_tokenizer("Qwen3-8B/")                    # tokenizer.json + its chat template
    opts = ChatOptions(seq_len=2048, format="messages", train_on="assistant")
    corpus = encode_corpus([["chats.jsonl"]], tok, opts)      # ids + trained-token masks, once
    source = ChatSource(corpus, seq_len=2048, packing="best_fit")
    batch = source.batch(step, dp_rank, dp_size, global_batch, 2048)   # Batch with labels

One concept per file: ``_records`` (reading JSONL / Parquet / datasets directories),
``_formats`` (a record to a conversation), ``_template`` (the sandboxed renderer), ``_encode``
(tokens and masks), ``_corpus`` (the encoded, cached corpus), ``_source`` (epochs, packing,
batches). The guide: docs/fine-tuning.md.
"""

from ._corpus import ChatOptions, Corpus, corpus_key, encode_corpus
from ._encode import ChatEncoder, ChatTokenizer, Encoded, load_chat_tokenizer, template_text
from ._formats import FORMATS, TRAIN_ON, Conversation, RecordError, to_conversation
from ._records import expand_paths, read_records
from ._source import PACKING, ChatSource
from ._template import ChatTemplate, TemplateLimitError

__all__ = [
    "FORMATS",
    "PACKING",
    "TRAIN_ON",
    "ChatEncoder",
    "ChatOptions",
    "ChatSource",
    "ChatTemplate",
    "ChatTokenizer",
    "Conversation",
    "Corpus",
    "Encoded",
    "RecordError",
    "TemplateLimitError",
    "corpus_key",
    "encode_corpus",
    "expand_paths",
    "load_chat_tokenizer",
    "read_records",
    "template_text",
    "to_conversation",
]
