"""Tokenize a JSON-lines corpus into Megatron indexed datasets (``.bin`` + ``.idx``).

Output: ``{output_prefix}_{json_key}_{document|sentence}.{bin,idx}`` per ``--json-keys`` entry
(``sentence`` with ``--split-sentences``). One JSON line is one document.

Pipeline: the parent cuts the input into blocks of whole lines; a pool of ``--workers``
processes parses and tokenizes each block with the tokenizer's batch encoder and returns NumPy
arrays; the parent appends them to the datasets in input order with one bulk write per block.
``--partitions N`` runs N such pipelines on N byte ranges of the input at once, then concatenates
their outputs, which are therefore identical to a single-partition run.

Bad lines (invalid JSON or UTF-8, missing key, non-string or empty text, a text the splitter or
tokenizer refuses, such as one with a lone surrogate) are skipped and
summarised at the end, or stop the run with ``--strict``. A run that would write no document (every
line skipped, empty input) or no token exits 1 and writes nothing.

Outputs are written under temporary names (``PREFIX.tmpPID``) and published only when complete
(``publish_dataset``: old ``.idx`` removed, new ``.bin`` renamed, new ``.idx`` renamed), so an
existing dataset of the same prefix survives any failure or ``kill -9`` until the new one is
ready. Long texts are tokenized in checked pieces (``tools/long_texts.py``):
memory grows by a few bytes per character, not the ~150 a tokenizer library needs in one call.
This module imports no torch.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import multiprocessing
import multiprocessing.connection
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    publish_dataset,
    remove_dataset,
    temporary_prefix,
)
from megatron.core.tokenizers import TOKENIZER_KEYWORDS, TOKENIZER_TYPES  # noqa: E402  (standard library only: fast start-up)
from tools.jsonl_input import (  # noqa: E402
    PUNKT_SAMPLE_BYTES,
    Range,
    SentenceSplitter,
    iter_blocks,
    parse_line,
    punkt_params,
    read_text_sample,
    split_ranges,
)
from tools.long_texts import tokenize_all  # noqa: E402
from tools.merge_datasets import write_merged  # noqa: E402
from tools.preprocess_encoder import Encoder  # noqa: E402, F401  (Megatron-LM's per-line API, re-exported)

BAD_REASONS = ("invalid_utf8", "invalid_json", "missing_key", "non_string", "empty_text", "tokenizer_error")
MAX_REPORTED = 10


class UsageError(Exception):
    """A problem with the command line or the environment, found before any work starts."""


class BadInputError(Exception):
    """A bad input line under ``--strict``."""


class NoOutputError(Exception):
    """The run would write a dataset without documents or without tokens."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse Megatron's preprocessing flags (plus ``--strict``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, a directory of them, or a glob")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (NLTK Punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep the newlines between split sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece/TikToken model or HF directory")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None, help="BPE merge file")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (NullTokenizer)")
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--tiktoken-pattern", default=None, help="v1, v2 or a regular expression")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None)
    g.add_argument("--append-eod", action="store_true", help="append an end-of-document token to each document")
    g.add_argument("--lang", default="english", help="language of the NLTK Punkt sentence splitter")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (in total, over all partitions)")
    g.add_argument("--partitions", type=int, default=1, help="process the input in this many parts, then merge")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every this many documents")
    g.add_argument("--strict", action="store_true", help="stop at the first bad input line")
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="Megatron's flag to keep input order with --partitions; the order is always kept here",
    )
    args = p.parse_args(argv)
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be at least 1")
    return args


def resolve_inputs(spec: str) -> List[str]:
    """The input files named by ``--input``: a file, every ``*.json``/``*.jsonl`` of a directory, or a glob."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.endswith((".json", ".jsonl")))
        if not files:
            raise UsageError(f"--input {spec}: directory has no *.json or *.jsonl files")
        return files
    if os.path.isfile(spec):
        return [spec]
    files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise UsageError(f"--input {spec}: no such file")
    return files


def check_output_prefix(prefix: str) -> None:
    """Fail early when the output directory is missing or not writable."""
    out_dir = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output-prefix {prefix}: directory {out_dir} does not exist")
    try:  # os.access is not enough: it says yes to root on read-only mounts
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise UsageError(f"--output-prefix {prefix}: cannot write to {out_dir} ({e.strerror})") from None


def tokenizer_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments of ``build_tokenizer``; it checks the files each type needs, naming the flag."""
    # This tool has no --trust-remote-code (Megatron's preprocess_data.py neither): left at its default.
    return {name: getattr(args, name) for name in TOKENIZER_KEYWORDS if name != "trust_remote_code"}


def build_tokenizer(tokenizer_type: str, kwargs: Dict[str, Any]) -> Any:
    """Build the tokenizer; any failure becomes a ``UsageError`` (imported lazily: start-up time)."""
    from megatron.core.tokenizers import build_tokenizer as _build

    try:
        return _build(tokenizer_type, **kwargs)
    except Exception as e:  # any library's loading error: report it as a usage problem
        raise UsageError(f"cannot build {tokenizer_type}: {type(e).__name__}: {_as_flags(str(e))}") from None


def _as_flags(message: str) -> str:
    """The core names ``build_tokenizer``'s keywords (``vocab_file=...``); this tool's flags are ``--vocab-file``."""
    return re.sub(r"(?<![\w.-])([a-z_]+)=", lambda m: _flag(m.group(1)), message)


def _flag(name: str) -> str:
    known = name == "tokenizer_type" or name in TOKENIZER_KEYWORDS
    return "--" + name.replace("_", "-") + "=" if known else name + "="


# --------------------------------------------------------------------------------------------
# Worker side: one block of lines -> arrays
# --------------------------------------------------------------------------------------------
@dataclass
class EncodeConfig:
    """Everything a worker needs; pickled to each worker process."""

    json_keys: List[str]
    tokenizer_type: str
    tokenizer_kwargs: Dict[str, Any]
    dtype: Any
    append_eod: bool
    strict: bool
    splitter_params: Any = None
    keep_newlines: bool = False
    quiet_threads: bool = False


_WORKER: Dict[str, Any] = {}


def init_worker(cfg: EncodeConfig, tokenizer: Any = None) -> None:
    """Set up the tokenizer and sentence splitter of this process."""
    if cfg.quiet_threads:  # one process per core is the parallelism; no nested thread pools
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["cfg"] = cfg
    _WORKER["tok"] = tokenizer if tokenizer is not None else build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_kwargs)
    _WORKER["split"] = SentenceSplitter(cfg.splitter_params, cfg.keep_newlines) if cfg.splitter_params else None
    _WORKER["eod"] = _WORKER["tok"].eod if cfg.append_eod else None


def _flatten(ids: List[Any], lengths: np.ndarray, dtype: Any) -> np.ndarray:
    """All sequences' ids in one array (lists and arrays alike)."""
    if not any(isinstance(x, np.ndarray) for x in ids):
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return np.concatenate([np.asarray(x, dtype=dtype) for x in ids]) if ids else np.zeros(0, dtype)


def encode_texts(texts: List[str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, sequence lengths and cumulative sequences per document for one key's texts."""
    tok, split, eod, dtype = _WORKER["tok"], _WORKER["split"], _WORKER["eod"], _WORKER["cfg"].dtype
    parts = [split(t) for t in texts] if split else [[t] for t in texts]
    ids = tokenize_all(tok, [s for d in parts for s in d], dtype)
    # Per-token work stays in NumPy: one flat array, then vectorised bookkeeping per sequence.
    raw_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = _flatten(ids, raw_lengths, dtype)
    del ids
    kept = raw_lengths > 0  # Megatron drops sequences that tokenize to nothing
    kept_before = np.concatenate([[0], np.cumsum(kept)])
    sentence_ends = np.cumsum([len(d) for d in parts], dtype=np.int64)
    doc_ends = kept_before[sentence_ends] if len(parts) else np.zeros(0, np.int64)
    lengths = raw_lengths[kept]
    if eod is not None and len(lengths):
        starts = np.concatenate([[0], doc_ends[:-1]])
        last = doc_ends[doc_ends > starts] - 1  # last sequence of each non-empty document
        tokens = np.insert(tokens, np.cumsum(lengths)[last], np.asarray(eod, dtype=tokens.dtype))
        lengths[last] += 1
    return tokens, lengths, doc_ends


def encode_block(task: Tuple[str, int, bytes]) -> Dict[str, Any]:
    """Parse and tokenize one block of whole lines (runs in a worker)."""
    path, first_line, block = task
    keys = _WORKER["cfg"].json_keys
    lines = block.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    docs: List[Tuple[int, List[str]]] = []  # (line number, texts per key)
    bad: List[Tuple[int, str, str]] = []  # (line number, reason, message)
    for lineno, raw in enumerate(lines, first_line):
        texts, problem = parse_line(raw, keys)
        if problem:
            bad.append((lineno, problem[0], f"{path}:{lineno}: {problem[1]}"))
            if _WORKER["cfg"].strict:  # the parent stops at the first bad line: only earlier ones matter
                break
            continue
        docs.append((lineno, texts))
    encoded, good, failed = encode_documents(keys, docs)
    bad += [(lineno, "tokenizer_error", f"{path}:{lineno}: {message}") for lineno, message in failed]
    bad.sort(key=lambda b: b[0])  # input order, so --strict names the first bad line
    return dict(encoded=encoded, docs=good, nbytes=len(block), bad=[(reason, msg) for _, reason, msg in bad])


def encode_documents(
    keys: Sequence[str], docs: List[Tuple[int, List[str]]]
) -> Tuple[Dict[str, Any], int, List[Tuple[int, str]]]:
    """Encoded arrays per key, the number of documents encoded, and ``(line, message)`` of each
    line the splitter or tokenizer refused (a lone surrogate, a non-number for NullTokenizer, ...).

    The block is encoded in one batch; only when that raises is each line tried alone, so a bad
    line costs its block a second pass and drops nothing but itself.
    """
    failed: List[Tuple[int, str]] = []
    try:
        return _encode_keys(keys, docs), len(docs), failed
    except Exception:  # some line's text is refused: found below, one line at a time
        pass
    good = []
    for lineno, texts in docs:
        try:
            _encode_keys(keys, [(lineno, texts)])
        except Exception as e:  # any library's error: this line is skipped, counted and named
            failed.append((lineno, f"tokenizer failed: {type(e).__name__}: {str(e)[:200]}"))
            continue
        good.append((lineno, texts))
    return _encode_keys(keys, good), len(good), failed


def _encode_keys(keys: Sequence[str], docs: List[Tuple[int, List[str]]]) -> Dict[str, Any]:
    return {k: encode_texts([texts[i] for _, texts in docs]) for i, k in enumerate(keys)}


# --------------------------------------------------------------------------------------------
# Parent side: blocks in, datasets out
# --------------------------------------------------------------------------------------------
@dataclass
class Summary:
    """Counts of one run (or one partition)."""

    docs: int = 0
    nbytes: int = 0
    tokens: Dict[str, int] = field(default_factory=dict)  # per JSON key
    bad_counts: Dict[str, int] = field(default_factory=lambda: {r: 0 for r in BAD_REASONS})
    bad_examples: List[str] = field(default_factory=list)

    def add_bad(self, reason: str, message: str) -> None:
        self.bad_counts[reason] += 1
        if len(self.bad_examples) < MAX_REPORTED:
            self.bad_examples.append(f"{message} [{reason}]")

    def merge(self, other: Summary) -> None:
        self.docs += other.docs
        self.nbytes += other.nbytes
        for key, n in other.tokens.items():
            self.tokens[key] = self.tokens.get(key, 0) + n
        for reason, n in other.bad_counts.items():
            self.bad_counts[reason] += n
        self.bad_examples = (self.bad_examples + other.bad_examples)[:MAX_REPORTED]


class Progress:
    """Prints a progress line every ``interval`` documents."""

    def __init__(self, interval: int, total_bytes: int, tag: str = "") -> None:
        self.interval, self.total_bytes, self.tag = interval, total_bytes, tag
        self.start = time.time()
        self.next_at = interval

    def update(self, docs: int, nbytes: int) -> None:
        if docs < self.next_at:
            return
        self.next_at = (docs // self.interval + 1) * self.interval
        elapsed = max(time.time() - self.start, 1e-9)
        eta = elapsed * (self.total_bytes - nbytes) / nbytes if nbytes else float("nan")
        print(
            f"{self.tag}processed {docs} documents ({docs / elapsed:.1f} docs/s, "
            f"{nbytes / elapsed / 1e6:.2f} MB/s), elapsed {elapsed:.1f} s, ETA {eta:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def output_prefix(prefix: str, key: str, split_sentences: bool) -> str:
    """Megatron's output name of one JSON key."""
    return f"{prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def _remove_outputs(prefixes: Sequence[str]) -> None:
    for p in prefixes:
        remove_dataset(p)


def _results(cfg: EncodeConfig, workers: int, tokenizer: Any, blocks: Iterator) -> Iterator[Dict[str, Any]]:
    """Encoded blocks in input order; at most ``2 * workers`` in flight (bounded memory)."""
    if workers == 1:
        init_worker(cfg, tokenizer)
        yield from map(encode_block, blocks)
        return
    with multiprocessing.Pool(workers, initializer=init_worker, initargs=(cfg,)) as pool:
        pending: collections.deque = collections.deque()
        for block in blocks:
            pending.append(pool.apply_async(encode_block, (block,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def process_ranges(
    cfg: EncodeConfig,
    ranges: Sequence[Range],
    prefixes: Sequence[str],
    workers: int,
    log_interval: int,
    tokenizer: Any = None,
    tag: str = "",
) -> Summary:
    """Tokenize ``ranges`` into one dataset per JSON key at ``prefixes`` (temporary or partition
    names: ``main`` publishes them); partial outputs are removed on failure."""
    _remove_outputs(prefixes)
    builders = [IndexedDatasetBuilder(get_bin_path(p), dtype=cfg.dtype) for p in prefixes]
    summary = Summary()
    progress = Progress(log_interval, sum(e - s for _, s, e in ranges), tag)
    try:
        for res in _results(cfg, workers, tokenizer, iter_blocks(ranges)):
            for reason, message in res["bad"]:
                if cfg.strict:
                    raise BadInputError(f"{message} [{reason}]")
                summary.add_bad(reason, message)
            for builder, key in zip(builders, cfg.json_keys):
                builder.add_documents(*res["encoded"][key])
                summary.tokens[key] = summary.tokens.get(key, 0) + len(res["encoded"][key][0])
            summary.docs += res["docs"]
            summary.nbytes += res["nbytes"]
            progress.update(summary.docs, summary.nbytes)
        for builder, p in zip(builders, prefixes):
            builder.finalize(get_idx_path(p))
    except BaseException:
        for builder in builders:
            builder.close()
        _remove_outputs(prefixes)
        raise
    return summary


# --------------------------------------------------------------------------------------------
# Partitions and the entry point
# --------------------------------------------------------------------------------------------
def _partition_child(
    conn: Any, cfg: EncodeConfig, ranges: List[Range], prefixes: List[str], workers: int, log_interval: int, tag: str
) -> None:
    try:
        conn.send(("ok", process_ranges(cfg, ranges, prefixes, workers, log_interval, tag=tag)))
    except BadInputError as e:
        conn.send(("bad", str(e)))
    except BaseException as e:  # report everything: the parent prints it and exits non-zero
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_partitions(
    cfg: EncodeConfig,
    parts: List[List[Range]],
    prefixes: List[str],
    workers: int,
    log_interval: int,
    out_prefixes: List[str],
) -> Summary:
    """Process the partitions at once in child processes, then concatenate their outputs at
    ``out_prefixes`` (the temporary names of ``prefixes``), unless no document was read."""
    n = len(parts)
    part_prefixes = [[f"{p}.partition{k}" for p in prefixes] for k in range(n)]
    ctx = multiprocessing.get_context()
    children, conns = [], []
    for k in range(n):
        recv, send = ctx.Pipe(duplex=False)
        args = (send, cfg, parts[k], part_prefixes[k], max(1, workers // n), log_interval, f"[partition {k}] ")
        child = ctx.Process(target=_partition_child, args=args)
        child.start()
        send.close()
        children.append(child)
        conns.append(recv)
    try:
        summaries = [_partition_result(c, conn) for c, conn in zip(children, conns)]
        total = Summary()
        for s in summaries:
            total.merge(s)
        if total.docs:
            for k, out in enumerate(out_prefixes):
                write_merged([pp[k] for pp in part_prefixes], out)
        return total
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
            child.join()
        for pp in part_prefixes:
            _remove_outputs(pp)


def _partition_result(child: Any, conn: Any) -> Summary:
    try:
        status, value = conn.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"a partition process died (exit code {child.exitcode})") from None
    if status == "bad":
        raise BadInputError(value)
    if status == "error":
        raise RuntimeError(value)
    return value


def report(summary: Summary, elapsed: float, prefixes: Sequence[str]) -> None:
    """Print the end-of-run summary: throughput, outputs and skipped lines."""
    mb = summary.nbytes / 1e6
    print(
        f"done: {summary.docs} documents, {mb:.2f} MB in {elapsed:.2f} s "
        f"({summary.docs / max(elapsed, 1e-9):.1f} docs/s, {mb / max(elapsed, 1e-9):.2f} MB/s)",
        file=sys.stderr,
    )
    for p in prefixes:
        print(f"wrote {get_bin_path(p)} and {get_idx_path(p)}", file=sys.stderr)
    report_skipped(summary)


def report_skipped(summary: Summary) -> None:
    """Print the counts of skipped lines and the first few of them."""
    skipped = sum(summary.bad_counts.values())
    if skipped:
        counts = ", ".join(f"{r}={n}" for r, n in summary.bad_counts.items() if n)
        print(f"skipped {skipped} bad lines: {counts}; the first {len(summary.bad_examples)}:", file=sys.stderr)
        for line in summary.bad_examples:
            print(f"  {line}", file=sys.stderr)


def check_output(summary: Summary, keys: Sequence[str], prefixes: Sequence[str]) -> None:
    """Raise ``NoOutputError`` when a dataset would hold no document or no token."""
    skipped = sum(summary.bad_counts.values())
    if summary.docs == 0:
        why = f"all {skipped} input lines were skipped" if skipped else "the input has no lines"
        raise NoOutputError(f"no documents: {why}")
    for key, p in zip(keys, prefixes):
        if summary.tokens.get(key, 0) == 0:
            raise NoOutputError(f"--json-keys {key}: {summary.docs} documents but no tokens for {p}")


def _tokenize(
    cfg: EncodeConfig,
    args: argparse.Namespace,
    parts: List[List[Range]],
    prefixes: List[str],
    temps: List[str],
    tokenizer: Any,
) -> Summary:
    """Run the single or partitioned pipeline; complete datasets are left at ``temps``."""
    if args.partitions == 1:
        return process_ranges(cfg, parts[0], temps, args.workers, args.log_interval, tokenizer)
    return run_partitions(cfg, parts, prefixes, args.workers, args.log_interval, temps)


def prepare(args: argparse.Namespace) -> Tuple[EncodeConfig, List[str], Any]:
    """Check everything that can fail before the work starts; build the configuration."""
    files = resolve_inputs(args.input)
    check_output_prefix(args.output_prefix)
    kwargs = tokenizer_kwargs(args)
    tokenizer = build_tokenizer(args.tokenizer_type, kwargs)
    if args.append_eod:
        try:
            _ = tokenizer.eod
        except Exception as e:
            raise UsageError(f"--append-eod: {args.tokenizer_type} has no end-of-document token ({e})") from None
    cfg = EncodeConfig(
        json_keys=list(args.json_keys),
        tokenizer_type=args.tokenizer_type,
        tokenizer_kwargs=kwargs,
        dtype=DType.optimal_dtype(tokenizer.vocab_size),
        append_eod=args.append_eod,
        strict=args.strict,
        keep_newlines=args.keep_newlines,
        quiet_threads=args.workers > 1,
    )
    if args.split_sentences:
        sample = read_text_sample(files, args.json_keys, PUNKT_SAMPLE_BYTES)
        cfg.splitter_params, source = punkt_params(args.lang, sample)
        print(f"sentence splitter: {source}", file=sys.stderr)
    return cfg, files, tokenizer


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool; returns the process exit status."""
    args = get_args(argv)
    start = time.time()
    try:
        cfg, files, tokenizer = prepare(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prefixes = [output_prefix(args.output_prefix, k, args.split_sentences) for k in args.json_keys]
    # Written under temporary names and published only when complete (kill -9 keeps old outputs).
    temps = [temporary_prefix(p) for p in prefixes]
    try:
        summary = _tokenize(cfg, args, split_ranges(files, args.partitions), prefixes, temps, tokenizer)
        check_output(summary, args.json_keys, prefixes)
        for tmp, p in zip(temps, prefixes):
            publish_dataset(tmp, p)
    except BadInputError as e:
        print(f"error: bad input (--strict): {e}", file=sys.stderr)
        return 1
    except NoOutputError as e:
        report_skipped(summary)
        kept = [p for p in prefixes if os.path.exists(get_idx_path(p))]
        print(
            f"error: {e}; nothing written" + (f" (existing {', '.join(kept)} left unchanged)" if kept else ""),
            file=sys.stderr,
        )
        return 1
    finally:
        _remove_outputs(temps)
    report(summary, time.time() - start, prefixes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
