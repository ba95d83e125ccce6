"""hpservice.data: deterministic token sources for the distributed trainer (no downloads).

source = build_source("synthetic", vocab_size=256, seed=0)     # learnable Markov-chain tokens
source = build_source("tokens", path="train.bin", seed=0)      # nanoGPT-style uint16/uint32 .bin
source = build_source("text", path="corpus.txt", seed=0)       # UTF-8 text, byte tokens (vocab 256)
batch = source.batch(step, dp_rank, dp_size, global_batch, seq_len)   # Batch: inputs, labels

The global batch of a step depends on (seed, step) -- and the batch shape -- only, never on the
world size; rank r gets its contiguous slice of it. The same data for any dp_size, and a resumed
run continues the exact sequence: the step number is the whole data-loader state.
"""

from ._base import TokenSource, local_batch_size
from ._batch import IGNORE_INDEX, Batch
from ._build import SOURCE_KINDS, build_source
from ._files import TextFile, TokenFile, resolve_token_dtype, write_token_file
from ._prepare import (
    EOS_CANDIDATES,
    DataPrepError,
    prepare_data,
    read_metadata,
    token_file_suffix,
    tokenizer_vocab_size,
    train_tokenizer,
    val_path,
)
from ._synthetic import SyntheticTokens
from ._tokenizer import ByteTokenizer

__all__ = [
    "EOS_CANDIDATES",
    "IGNORE_INDEX",
    "SOURCE_KINDS",
    "Batch",
    "ByteTokenizer",
    "DataPrepError",
    "SyntheticTokens",
    "TextFile",
    "TokenFile",
    "TokenSource",
    "build_source",
    "local_batch_size",
    "prepare_data",
    "read_metadata",
    "resolve_token_dtype",
    "token_file_suffix",
    "tokenizer_vocab_size",
    "train_tokenizer",
    "val_path",
    "write_token_file",
]
