"""The trainer's data: a source per data section (``build_dataset``) and this rank's batch of a step.

``build_dataset`` is where a data kind becomes a ``TokenSource``; a new kind is a source in
``hpservice.data`` and a branch here. ``RankBatches`` asks the source for this data-parallel
rank's rows of a step and adds what the job's attention needs (document ids from the end-of-text
tokens under ``data.document_mask``), so the loop sees one ``Batch``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpservice.data import Batch, TokenSource, build_source
from hpservice.inputs import MAX_TOKENIZER_BYTES, read_input
from hpservice.parallel.context_parallel import document_ids_from_eos

from ._errors import TrainingError

__all__ = ["RankBatches", "build_data", "build_dataset"]


def _file_key(path: str, tokenizer: str) -> str:
    """Names a tokenized copy: the text file's size and mtime and the tokenizer's bytes."""
    st = Path(path).stat()
    h = hashlib.sha256(f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(read_input(tokenizer, MAX_TOKENIZER_BYTES))
    return h.hexdigest()[:12]


def _check_token_metadata(path: str, vocab: int | None) -> None:
    """A token file from ``hpservice prepare-data`` carries its tokenizer's vocabulary and dtype:
    refuse one the model cannot embed, or one whose dtype differs from what the reader infers."""
    from hpservice.data import read_metadata, resolve_token_dtype

    meta = read_metadata(path)
    if meta is None:
        return
    if vocab is not None and meta["vocab_size"] > vocab:
        raise TrainingError(
            f"data.path {path}: tokenized with a vocabulary of {meta['vocab_size']} ({meta.get('tokenizer')}), "
            f"larger than the model's {vocab}"
        )
    if resolve_token_dtype(path).name != meta["dtype"]:
        raise TrainingError(
            f"data.path {path}: holds {meta['dtype']} tokens but would be read as {resolve_token_dtype(path).name}"
        )


def _tokenized_text(d, vocab: int | None, run_dir: Path, rank: int, world: int) -> TokenSource:
    """Text with a ``tokenizer``: rank 0 tokenizes it once into a token file in the run's
    directory (``prepare-data``'s format; reused by restarts of the run) while the others wait,
    then every rank reads that file."""
    from hpservice.data import prepare_data, token_file_suffix, tokenizer_vocab_size

    for what, path in (("data.path", d.path), ("data.tokenizer", d.tokenizer)):
        if not Path(path).is_file():  # every rank sees it: they all stop with this reason
            raise TrainingError(f"{what}: {path}: no such file")
    try:  # every rank reads it: they all stop with the same reason
        suffix = token_file_suffix(tokenizer_vocab_size(d.tokenizer))  # uint32 files past 65,536 tokens
    except Exception as e:  # tokenizers raises its own exception type
        raise TrainingError(f"data.tokenizer: {d.tokenizer}: cannot load a tokenizers tokenizer.json ({e})") from e
    cache = run_dir / "data" / f"{Path(d.path).name}.{_file_key(d.path, d.tokenizer)}{suffix}"
    failure = [None]  # rank 0's error, if any, so every rank stops with it (no rank waits forever)
    if rank == 0 and not cache.exists():
        try:
            prepare_data([d.path], cache, d.tokenizer)
        except (ValueError, OSError) as e:
            failure = [str(e)]
    if world > 1:
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise TrainingError(f"data.tokenizer: {failure[0]}")
    _check_token_metadata(str(cache), vocab)
    return build_source("tokens", path=cache, vocab_size=vocab, seed=d.seed)


def chat_inputs(d, init_from: str | None):
    """(the sources' paths, their weights, the ChatTokenizer) of a chat data section; the
    tokenizer is ``data.tokenizer``, else the ``model.init_from`` checkpoint's."""
    from hpservice.data.chat import load_chat_tokenizer, template_text

    tokenizer = d.tokenizer or init_from
    if tokenizer is None:
        raise TrainingError(f"data.tokenizer: kind {d.kind!r} needs a tokenizer directory (or model.init_from's)")
    sources = [([s.path], s.weight) for s in d.sources] if d.sources else [([d.path], 1.0)]
    try:
        tok = load_chat_tokenizer(tokenizer, template_text(d.chat_template))
    except (OSError, ValueError) as e:
        raise TrainingError(f"data.tokenizer: {e}") from e
    return [p for p, _ in sources], [w for _, w in sources], tok


def _chat(d, vocab: int | None, run_dir: Path, rank: int, world: int, init_from: str | None) -> TokenSource:
    """Chat data: rank 0 encodes every record once into the run's directory (reused by restarts)
    while the others wait, then every rank reads the arrays (``hpservice.data.chat``)."""
    import os

    from hpservice.data.chat import ChatOptions, ChatSource, Corpus, corpus_key, encode_corpus

    paths, weights, tok = chat_inputs(d, init_from)
    opts = ChatOptions(
        seq_len=d.seq_len, format=d.format, fields=tuple(sorted(d.fields.items())), train_on=d.train_on,
        train_eos=d.train_eos, truncation=d.truncation, on_bad_record=d.on_bad_record,
    )  # fmt: skip
    failure = [None]
    try:
        cache = run_dir / "data" / f"chat-{corpus_key(paths, tok, opts)}"
    except (OSError, ValueError) as e:
        cache, failure = None, [f"data.path: {e}"]
    if rank == 0 and cache is not None and not cache.exists():
        try:
            workers = max(0, min(4, (os.cpu_count() or 1) // world - 1))
            encode_corpus(paths, tok, opts, workers=workers).save(cache)
        except (OSError, ValueError) as e:
            failure = [f"data: {e}"]
    if world > 1:
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise TrainingError(failure[0])
    corpus = Corpus.load(cache)
    top = int(np.asarray(corpus.tokens).max())
    if vocab is not None and top >= vocab:
        raise TrainingError(f"data.tokenizer: token id {top} is outside the model's vocabulary of {vocab}")
    return ChatSource(corpus, seq_len=d.seq_len, seed=d.seed, packing=d.packing, weights=weights, vocab_size=vocab, pad_id=_pad_id(tok))


def _preference(d, vocab: int | None, init_from: str | None) -> TokenSource:
    """Preference pairs (DPO), encoded by every rank alike (``hpservice.data.preference``)."""
    from hpservice.data.preference import PreferenceSource, encode_preferences

    _, _, tok = chat_inputs(d, init_from)
    try:
        pairs = encode_preferences([d.path], tok, seq_len=d.seq_len, fields=dict(d.fields), truncation=d.truncation,
                                   on_bad_record=d.on_bad_record)  # fmt: skip
    except (OSError, ValueError) as e:
        raise TrainingError(f"data: {e}") from e
    source = PreferenceSource(pairs, seq_len=d.seq_len, seed=d.seed, vocab_size=vocab, pad_id=_pad_id(tok))
    if vocab is not None and source.max_token >= vocab:
        raise TrainingError(f"data.tokenizer: token id {source.max_token} is outside the model's vocabulary of {vocab}")
    return source


def _pad_id(tok) -> int:
    pad = tok.special_tokens.get("pad_token") or tok.special_tokens.get("eos_token")
    if pad is None:
        return 0
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tok.tokenizer_json).token_to_id(pad) or 0


def build_dataset(d, vocab: int | None, run_dir: Path, *, rank: int, world: int, init_from: str | None = None) -> TokenSource:
    """The source of a data section (``data`` or ``eval.data``) by its kind."""
    if d.kind == "preference":
        return _preference(d, vocab, init_from)
    if d.kind == "chat":
        return _chat(d, vocab, run_dir, rank, world, init_from)
    if d.kind == "text" and d.tokenizer is not None:
        return _tokenized_text(d, vocab, run_dir, rank, world)
    if d.kind == "tokens":
        _check_token_metadata(d.path, vocab)
    return build_source(d.kind, path=d.path, vocab_size=vocab if d.kind != "text" else None, seed=d.seed)


def document_eos(d, source: TokenSource) -> int:
    """The token that ends a document (``data.document_mask``): ``data.eos_id``, else the one
    prepare-data recorded beside the token file (the run's own token cache for text)."""
    if d.eos_id is not None:
        return d.eos_id
    from hpservice.data import read_metadata

    path = getattr(source, "path", None)
    meta = read_metadata(str(path)) if path is not None else None
    if not meta or meta.get("eos_id") is None:
        raise TrainingError(
            f"data.document_mask: {path} records no end-of-text token (not written by hpservice prepare-data?); "
            "set data.eos_id"
        )
    return int(meta["eos_id"])


class RankBatches:
    """This data-parallel rank's batches of a data section, on the rank's device; with
    ``eos_id`` (``data.document_mask``, for training and validation alike), with the document
    ids its end-of-text tokens mark."""

    def __init__(self, source: TokenSource, d, *, dp_rank: int, dp_size: int, device: torch.device, eos_id=None):
        self.source, self.global_batch, self.seq_len = source, d.global_batch, d.seq_len
        self.dp_rank, self.dp_size, self.device, self.eos_id = dp_rank, dp_size, device, eos_id

    @property
    def global_tokens(self) -> int:
        """Positions a step trains on: preference pairs are two rows each."""
        return self.global_batch * self.seq_len * getattr(self.source, "rows_per_sample", 1)

    @property
    def every_label_valid(self) -> bool:
        return self.source.every_label_valid

    def facts(self, step: int) -> dict:
        """Step metrics the source knows (chat data: the epoch, the packing efficiency)."""
        facts = getattr(self.source, "step_facts", None)
        return facts(step, self.global_batch) if facts is not None else {}

    def __call__(self, step: int) -> Batch:
        batch = self.source.batch(step, self.dp_rank, self.dp_size, self.global_batch, self.seq_len)
        if self.eos_id is not None and batch.document_ids is None:
            batch = Batch(batch.inputs, batch.labels, document_ids_from_eos(batch.inputs, self.eos_id), batch.positions)
        return batch.to(self.device)


def build_data(spec, dims, vocab: int | None, run_dir: Path, device: torch.device):
    """This rank's training batches and, with ``eval.interval``, its validation batches (masked
    into documents as training's under ``data.document_mask``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    init_from = spec.model.init_from
    source = build_dataset(spec.data, vocab, run_dir, rank=rank, world=world, init_from=init_from)
    eos = document_eos(spec.data, source) if spec.data.document_mask else None
    where = {"dp_rank": dims.dp_rank, "dp_size": dims.dp_size, "device": device, "eos_id": eos}
    train = RankBatches(source, spec.data, **where)
    if not spec.eval.interval:
        return train, None
    eval_source = build_dataset(spec.eval.data, vocab, run_dir, rank=rank, world=world, init_from=init_from)
    return train, RankBatches(eval_source, spec.eval.data, **where)
