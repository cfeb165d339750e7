"""tools/preprocess_data.py and tools/merge_datasets.py end to end on tiny corpora.

Expected token ids come from the tokenizer itself, applied to each document (or to each sentence,
found here with a plain regular expression), never from a previous run of the tool.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_idx_path
from megatron.core.tokenizers import build_tokenizer
from tests.tokenizer_files import corpus_texts, make_tokenizer_files, megatron_flags
from tools import long_texts, merge_datasets, preprocess_data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Sentences end with a period after a long word, so Punkt has no abbreviation to doubt.
TEXTS = [
    "Tokenizers split words into pieces. Datasets store their identifiers contiguously.",
    'Único documento con acentos y comillas "dobles" también.',
    "Pipelines overlap communication.\nGradients accumulate across microbatches. Checkpoints persist.",
    "Short one without final period",
    "Embedding tables grow with vocabulary.\n\nOptimizers update parameters afterwards.",
]
NUMBER_TEXTS = ["1 2 3", "4 5", "599 0 7 8 9", "42"]


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    return make_tokenizer_files(tmp_path_factory.mktemp("tok"))


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(
                (json.dumps(line) if not isinstance(line, bytes) else line.decode("latin-1")).encode("utf-8")
                if not isinstance(line, bytes)
                else line
            )
            f.write(b"\n")
    return str(path)


def sentences(text, keep_newlines):
    """Independent sentence split of TEXTS: a sentence ends at a period followed by whitespace."""
    pieces = re.findall(r".*?(?:\.(?=\s)|$)\s*", text, flags=re.S)
    pieces = [p for p in pieces if p]
    return pieces if keep_newlines else [p.strip() for p in pieces]


def run_tool(tmp_path, input_path, tok_flags, *extra, name="out"):
    prefix = str(tmp_path / name)
    argv = ["--input", input_path, "--output-prefix", prefix, *tok_flags, "--log-interval", "2", *extra]
    return preprocess_data.main(argv), prefix


def expected_sequences(tok, texts, split, keep_newlines, append_eod):
    """Per document, the list of sequences the tool must write."""
    docs = []
    for text in texts:
        parts = sentences(text, keep_newlines) if split else [text]
        seqs = [tok.tokenize(p) for p in parts]
        seqs = [s for s in seqs if s]
        if seqs and append_eod:
            seqs[-1] = seqs[-1] + [tok.eod]
        docs.append(seqs)
    return docs


def check_dataset(prefix, docs):
    ds = IndexedDataset(prefix)
    flat = [s for d in docs for s in d]
    assert len(ds) == len(flat)
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq, f"sequence {i}"
    return ds


TYPES = (
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "TikTokenizer",
    "HuggingFaceTokenizer",
)
NO_EOD = ("BertWordPieceLowerCase", "BertWordPieceCase")  # BERT vocabularies have no eod token


def _cases():
    """Every type with and without sentence splitting and eod; the parallel modes rotate over them."""
    cases = []
    for i, tok_type in enumerate(TYPES):
        for split in (False, True):
            for eod in (False,) if tok_type in NO_EOD else (False, True):
                keep_newlines = split and i % 2 == 1
                parallel = ("workers", "partitions", "none")[len(cases) % 3]
                cases.append((tok_type, split, keep_newlines, eod, parallel))
    return cases


@pytest.mark.parametrize("tok_type, split, keep_newlines, eod, parallel", _cases())
def test_every_tokenizer_round_trip(tmp_path, tok_files, tok_type, split, keep_newlines, eod, parallel):
    tok = build_tokenizer(tok_type, **tok_files[tok_type])
    src = write_lines(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    extra = (["--split-sentences"] if split else []) + (["--keep-newlines"] if keep_newlines else [])
    extra += ["--append-eod"] if eod else []
    extra += {"workers": ["--workers", "2"], "partitions": ["--partitions", "2"], "none": []}[parallel]
    rc, prefix = run_tool(tmp_path, src, megatron_flags(tok_type, tok_files[tok_type]), *extra)
    assert rc == 0
    level = "sentence" if split else "document"
    ds = check_dataset(f"{prefix}_text_{level}", expected_sequences(tok, TEXTS, split, keep_newlines, eod))
    assert ds.dtype == np.uint16  # vocabularies of the test tokenizers are far below 65500


def test_null_tokenizer_and_two_keys(tmp_path, tok_files):
    # "  " has no ids: its document holds no sequence and, as in Megatron, no eod either.
    lines = [{"text": t, "ids": t[::-1]} for t in NUMBER_TEXTS + ["  "]]
    src = write_lines(tmp_path / "in.jsonl", lines)
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    rc, prefix = run_tool(tmp_path, src, flags, "--json-keys", "text", "ids", "--append-eod")
    assert rc == 0
    eod = int(tok_files["NullTokenizer"]["vocab_size"])  # Megatron's null eod: one past the text ids
    for key in ("text", "ids"):
        want = [[[int(x) for x in line[key].split()] + [eod]] for line in lines[:-1]] + [[]]
        check_dataset(f"{prefix}_{key}_document", want)


def test_workers_and_partitions_match_single_process(tmp_path, tok_files, capsys):
    tok_flags = megatron_flags("GPT2BPETokenizer", tok_files["GPT2BPETokenizer"])
    tok = build_tokenizer("GPT2BPETokenizer", **tok_files["GPT2BPETokenizer"])
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    many = [f"{t} Number {i}." for i in range(12) for t in TEXTS]
    write_lines(in_dir / "a.jsonl", [{"text": t} for t in many[:30]])
    write_lines(in_dir / "b.jsonl", [{"text": t} for t in many[30:]] + [b"{broken"])
    outputs = {}
    for workers, parts in ((1, 1), (2, 1), (2, 2)):
        # Megatron's --keep-sequential-samples is accepted; every layout keeps the input order anyway.
        keep = ["--keep-sequential-samples"] if parts > 1 else []
        rc, prefix = run_tool(
            tmp_path,
            str(in_dir),
            tok_flags,
            "--split-sentences",
            "--append-eod",
            *keep,
            "--workers",
            str(workers),
            "--partitions",
            str(parts),
            name=f"w{workers}p{parts}",
        )
        assert rc == 0
        outputs[(workers, parts)] = [open(f"{prefix}_text_sentence{e}", "rb").read() for e in (".bin", ".idx")]
        err = capsys.readouterr().err
        assert "invalid_json=1" in err and f"b.jsonl:{len(many) - 30 + 1}:" in err
    assert outputs[(2, 1)] == outputs[(1, 1)] and outputs[(2, 2)] == outputs[(1, 1)]
    check_dataset(str(tmp_path / "w2p2_text_sentence"), expected_sequences(tok, many, True, False, True))
    assert not [n for n in os.listdir(tmp_path) if "partition" in n]  # temporary parts removed


BAD_LINES = [
    {"text": "Valid first line."},
    b"{not json",
    {"other": "no text key"},
    {"text": 7},
    {"text": ""},
    b'{"text": "bad \xff byte"}',
    [1, 2],
    {"text": "Valid last line."},
]


def test_bad_lines_skipped_counted_and_reported(tmp_path, tok_files, capsys):
    src = write_lines(tmp_path / "in.jsonl", BAD_LINES)
    tok_type = "GPT2BPETokenizer"
    rc, prefix = run_tool(tmp_path, src, megatron_flags(tok_type, tok_files[tok_type]))
    assert rc == 0
    err = capsys.readouterr().err
    assert "skipped 6 bad lines: invalid_utf8=1, invalid_json=2, missing_key=1, non_string=1, empty_text=1" in err
    for lineno, reason in [
        (2, "invalid_json"),
        (3, "missing_key"),
        (4, "non_string"),
        (5, "empty_text"),
        (6, "invalid_utf8"),
        (7, "invalid_json"),
    ]:
        assert re.search(rf"in\.jsonl:{lineno}: .*\[{reason}\]", err), (lineno, reason)
    tok = build_tokenizer(tok_type, **tok_files[tok_type])
    valid = [BAD_LINES[0]["text"], BAD_LINES[-1]["text"]]
    check_dataset(f"{prefix}_text_document", expected_sequences(tok, valid, False, False, False))


def test_strict_stops_with_message_and_no_output(tmp_path, tok_files, capsys):
    src = write_lines(tmp_path / "in.jsonl", BAD_LINES)
    flags = megatron_flags("GPT2BPETokenizer", tok_files["GPT2BPETokenizer"])
    rc, prefix = run_tool(tmp_path, src, flags, "--strict")
    assert rc == 1
    assert "in.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize("problem", ["missing_input", "output_dir", "vocab_file", "unknown_type"])
def test_usage_errors_before_any_work(tmp_path, tok_files, capsys, problem):
    src = write_lines(tmp_path / "in.jsonl", [{"text": "Hello there."}])
    gpt2 = tok_files["GPT2BPETokenizer"]
    flags = megatron_flags("GPT2BPETokenizer", gpt2)
    argv = ["--input", src, "--output-prefix", str(tmp_path / "out"), *flags]
    if problem == "missing_input":
        argv[1], match = str(tmp_path / "nope.jsonl"), "nope.jsonl: no such file"
    elif problem == "output_dir":
        argv[3], match = str(tmp_path / "in.jsonl" / "out"), "does not exist"
    elif problem == "vocab_file":
        argv[argv.index(gpt2["vocab_file"])], match = str(tmp_path / "v.json"), "--vocab-file=.*v.json.*no such file"
    else:
        argv[argv.index("GPT2BPETokenizer")], match = "NoSuchTokenizer", "invalid choice"
    if problem == "unknown_type":
        with pytest.raises(SystemExit) as e:
            preprocess_data.main(argv)
        assert e.value.code == 2
    else:
        assert preprocess_data.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def _snapshot(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_interrupted_run_keeps_the_previous_output(tmp_path, tok_files, monkeypatch):
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    src = write_lines(tmp_path / "in.jsonl", [{"text": t} for t in NUMBER_TEXTS])
    assert run_tool(tmp_path, src, flags)[0] == 0  # an older, complete output survives the run below
    before = _snapshot(tmp_path)
    assert len(before) == 3

    def interrupted(task):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess_data, "encode_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tool(tmp_path, src, flags)
    assert _snapshot(tmp_path) == before  # same files, same bytes, no temporary left


def test_merge_datasets_tool(tmp_path, tok_files, capsys):
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    parts = tmp_path / "parts"
    parts.mkdir()
    for k, texts in enumerate((NUMBER_TEXTS[:2], NUMBER_TEXTS[2:])):
        src = write_lines(tmp_path / f"in{k}.jsonl", [{"text": t} for t in texts])
        assert run_tool(parts, src, flags, name=f"p{k}")[0] == 0
    out = str(tmp_path / "merged")
    assert merge_datasets.main(["--input", str(parts), "--output-prefix", out]) == 0
    check_dataset(out, [[[int(x) for x in t.split()]] for t in NUMBER_TEXTS])
    wide = write_lines(tmp_path / "w.jsonl", [{"text": "1 2"}])
    assert run_tool(tmp_path, wide, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"], name="w")[0] == 0
    argv = ["--input", out, str(tmp_path / "w_text_document"), "--output-prefix", str(tmp_path / "x")]
    rc = merge_datasets.main(argv)
    assert rc == 1 and "different dtypes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.bin")


def test_tools_start_without_torch():
    code = (
        "import sys, time; t = time.time(); import tools.preprocess_data, tools.merge_datasets; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(time.time() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    helped = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "--split-sentences" in helped.stdout


def test_full_run_imports_no_torch(tmp_path, tok_files):
    src = write_lines(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    flags = megatron_flags("GPT2BPETokenizer", tok_files["GPT2BPETokenizer"])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o"), *flags, "--split-sentences"]
    code = (
        f"import sys; from tools import preprocess_data as p; rc = p.main({argv!r}); "
        "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------------------------
# Runs that write nothing, killed runs, long lines
# --------------------------------------------------------------------------------------------
def _previous_output(tmp_path, tok_files):
    """NullTokenizer flags and a folder ``out`` holding a complete earlier run; returns its snapshot too."""
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    out = tmp_path / "out"
    out.mkdir()
    old = write_lines(tmp_path / "old.jsonl", [{"text": t} for t in NUMBER_TEXTS])
    assert run_tool(out, old, flags)[0] == 0
    return flags, out, _snapshot(out)


@pytest.mark.parametrize("partitions", ["1", "2"])
def test_run_without_documents_fails_and_keeps_the_previous_output(tmp_path, tok_files, capsys, partitions):
    flags, out, before = _previous_output(tmp_path, tok_files)
    bad = write_lines(tmp_path / "bad.jsonl", [b"{not json", {"other": "1 2"}, {"text": ""}])
    assert run_tool(out, bad, flags, "--partitions", partitions)[0] == 1
    err = capsys.readouterr().err
    assert "skipped 3 bad lines" in err
    assert re.search(
        r"error: no documents: all 3 input lines were skipped; nothing written "
        r"\(existing .*out_text_document left unchanged\)",
        err,
    ), err
    assert _snapshot(out) == before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert run_tool(fresh, bad, flags)[0] == 1
    empty = write_lines(tmp_path / "empty.jsonl", [])
    assert run_tool(fresh, empty, flags)[0] == 1
    assert "error: no documents: the input has no lines; nothing written\n" in capsys.readouterr().err
    assert os.listdir(fresh) == []


def test_documents_without_tokens_fail(tmp_path, tok_files, capsys):
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    src = write_lines(tmp_path / "in.jsonl", [{"text": "   "}, {"text": "\n"}])
    assert run_tool(tmp_path, src, flags)[0] == 1
    assert "error: --json-keys text: 2 documents but no tokens for" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


_KILLER = """
import os, signal, sys
from megatron.core.datasets import indexed_dataset
from tools import preprocess_data

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

mode = sys.argv[1]
if mode == "encoding":  # after the first block was written to the new .bin
    add = indexed_dataset.IndexedDatasetBuilder.add_documents
    def add_then_die(self, *args):
        add(self, *args)
        self._data_file.flush()
        die()
    indexed_dataset.IndexedDatasetBuilder.add_documents = add_then_die
elif mode == "publishing":  # the new dataset is complete under its temporary name
    preprocess_data.publish_dataset = die
elif mode == "between_renames":  # the new .bin is in place, its .idx not yet
    replace = os.replace
    def replace_or_die(src, dst):
        if dst.endswith("_document.idx"):
            die()
        return replace(src, dst)
    os.replace = replace_or_die
sys.exit(preprocess_data.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("moment", ["encoding", "publishing", "between_renames"])
def test_kill_9_never_leaves_a_mismatched_pair(tmp_path, tok_files, moment):
    flags, out, before = _previous_output(tmp_path, tok_files)
    new = write_lines(tmp_path / "new.jsonl", [{"text": "7 7 7 7"}] * 3000)
    argv = ["--input", new, "--output-prefix", str(out / "out"), *flags]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, moment, *argv], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    prefix = str(out / "out_text_document")
    if moment == "between_renames":
        # The old .idx is gone before the new .bin arrives: the dataset is missing, never mismatched.
        assert not os.path.exists(get_idx_path(prefix))
        with pytest.raises(FileNotFoundError, match="index file not found"):
            IndexedDataset(prefix)
    else:
        final = {k: v for k, v in _snapshot(out).items() if ".tmp" not in k}
        assert final == before  # the old pair, byte for byte


def test_merge_failure_keeps_the_previous_output(tmp_path, tok_files, monkeypatch):
    flags = megatron_flags("NullTokenizer", tok_files["NullTokenizer"])
    for k, texts in enumerate((NUMBER_TEXTS[:2], NUMBER_TEXTS[2:])):
        src = write_lines(tmp_path / f"in{k}.jsonl", [{"text": t} for t in texts])
        assert run_tool(tmp_path, src, flags, name=f"p{k}")[0] == 0
    parts = [str(tmp_path / f"p{k}_text_document") for k in range(2)]
    out = str(tmp_path / "merged")
    merge_datasets.merge_datasets(parts[:1], out)
    before = _snapshot(tmp_path)

    def interrupted(self, prefix):
        raise KeyboardInterrupt

    monkeypatch.setattr(merge_datasets.IndexedDatasetBuilder, "add_index", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge_datasets.merge_datasets(parts, out)
    assert _snapshot(tmp_path) == before


def _long_text(chars):
    text = " ".join(corpus_texts(60_000))
    return (text * (chars // len(text) + 1))[:chars]


@pytest.mark.parametrize("tok_type", TYPES + ("NullTokenizer",))
def test_long_texts_tokenized_in_pieces_equal_whole(tmp_path, tok_files, monkeypatch, tok_type):
    monkeypatch.setattr(long_texts, "LONG_TEXT_CHARS", 400)
    monkeypatch.setattr(long_texts, "CUT_CONTEXT_CHARS", 40)
    cuts = []
    next_cut = long_texts._next_cut
    monkeypatch.setattr(long_texts, "_next_cut", lambda *a: cuts.append(next_cut(*a)) or cuts[-1])
    if tok_type == "NullTokenizer":
        texts = [" ".join(str(i % 600) for i in range(k, k + 700)) for k in (0, 5)]
    else:
        texts = [_long_text(5000), "short text", _long_text(3000)[::-1]]
    tok = build_tokenizer(tok_type, **tok_files[tok_type])
    src = write_lines(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    rc, prefix = run_tool(tmp_path, src, megatron_flags(tok_type, tok_files[tok_type]))
    assert rc == 0
    check_dataset(f"{prefix}_text_document", expected_sequences(tok, texts, False, False, False))
    if tok_type in ("GPT2BPETokenizer", "TikTokenizer", "NullTokenizer"):
        assert sum(1 for c in cuts if c is not None and c < 5000) >= 5  # the pieces were really used
    if tok_type == "Llama2Tokenizer":
        assert set(cuts) == {None}  # a BOS per piece would change the ids: never cut


_MAXRSS = (
    "import resource, sys; from tools import preprocess_data as p; rc = p.main(sys.argv[1:]); "
    "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
)


def _peak_rss_kb(tmp_path, text, tok_flags, name):
    src = write_lines(tmp_path / f"{name}.jsonl", [{"text": text}])
    argv = ["--input", src, "--output-prefix", str(tmp_path / name), *tok_flags]
    proc = subprocess.run([sys.executable, "-c", _MAXRSS, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split("MAXRSS_KB")[1])


def test_one_long_line_needs_memory_linear_in_its_size(tmp_path, tok_files):
    # Encoding a text in one call takes ~150 bytes per character in the tokenizer library; in
    # pieces, a 5 MB line stays within a few bytes per character of the tool's baseline.
    flags = megatron_flags("GPT2BPETokenizer", tok_files["GPT2BPETokenizer"])
    chars = 5_000_000
    base = _peak_rss_kb(tmp_path, "a tiny document", flags, "tiny")
    peak = _peak_rss_kb(tmp_path, _long_text(chars), flags, "long")
    assert (peak - base) * 1024 < 30 * chars, (base, peak)
