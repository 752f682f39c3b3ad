"""``python -m llmtrain.prepare [MODEL AND DATA OVERRIDES] out=DIR``: tokenize a text corpus once
into a token folder on disk, read block by block: for corpora larger than memory.

The overrides are those of ``python -m llmtrain`` (``model=...`` picks the tokenizer, ``data=...``
and ``data.*`` the text source; ``data.num_proc=N`` tokenizes in N processes). Train on the
result with ``data.format=tokens data.path=DIR`` (and the same model): the samples are the same
blocks ``data.format=text`` makes from the raw text, read without loading the corpus into memory.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    from llmtrain.config.compose import compose
    from llmtrain.config.validate import validate_data
    from llmtrain.data import text_documents, write_token_folder
    from llmtrain.common.errors import ConfigError, DataError
    from llmtrain.models.build import ModelSourceError, build_tokenizer
    from llmtrain.planning.preflight import preflight_data

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    outs = [a for a in args if a.startswith("out=")]
    overrides = [a for a in args if not a.startswith("out=")]
    try:
        if len(outs) != 1 or not outs[0][4:]:
            raise ConfigError("give the output folder once, as out=DIR")
        out = Path(outs[0][4:]).expanduser()
        if out.exists() and not out.is_dir():
            raise ConfigError(f"out={out} is a file; give a folder to create")
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"out={out} exists and is not empty; choose a new folder (nothing is overwritten)")
        cfg = compose(overrides)
        validate_data(cfg.data)
        preflight_data(cfg.data)
        if cfg.data.datasets or cfg.data.format != "text":
            raise ConfigError(f"llmtrain.prepare tokenizes one format=text source (got data.format={cfg.data.format}"
                              f"{', a mixture' if cfg.data.datasets else ''}); instruction and chat data are "
                              "cached on first use instead")
        tokenizer = build_tokenizer(cfg.model)
        started, cpu = time.perf_counter(), time.process_time()
        manifest = write_token_folder(text_documents(cfg.data, "data"), tokenizer, out, cfg.data.num_proc,
                                      source=str(cfg.data.path) if cfg.data.path is not None else "python stdlib")
    except (ConfigError, DataError, ModelSourceError) as err:
        print(f"llmtrain.prepare: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra's own override errors
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            print(f"llmtrain.prepare: error: {err}", file=sys.stderr)
            return 2
        raise
    seconds = time.perf_counter() - started
    print(f"prepared {manifest['num_tokens']:,} tokens from {manifest['num_documents']:,} documents "
          f"({manifest['source']}) with {manifest['tokenizer'] or 'the tokenizer'} into {out} in {seconds:.1f} s "
          f"({manifest['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s, {time.process_time() - cpu:.1f} s CPU in "
          f"this process, num_proc={cfg.data.num_proc}); train with: data.format=tokens data.path={out}")
    return 0


if __name__ == "__main__":
    from llmtrain.common.interrupt import one_line_on_ctrl_c

    with one_line_on_ctrl_c("llmtrain.prepare"):  # its imports are inside main()
        sys.exit(main())
