"""pip's install options as uv arguments, one per line, for scripts/setup.sh (uv reads no pip configuration).

Options come from pip's own parser, so config files and ``PIP_*`` variables merge as ``pip install``
merges them: the index (only where it is not PyPI's, so a uv configuration of your own stands
otherwise), extra indexes, find-links and constraints. A certificate bundle prints as
``SSL_CERT_FILE=<path>`` (what uv reads for one). Then the two arguments setup.sh always passes:
pick the best match across every index, as pip does, and byte-compile what is installed.

Run with the Python whose pip configuration applies (setup.sh: the one creating the environments):
``python scripts/uv_args.py``. Prints only the fixed arguments where pip cannot be read.
"""

from __future__ import annotations

PYPI = "https://pypi.org/simple"
ALWAYS = ("--index-strategy", "unsafe-best-match", "--compile-bytecode")


def pip_options() -> list[str]:
    """The uv arguments (and ``SSL_CERT_FILE=...``) pip's configuration implies."""
    from pip._internal.commands import create_command  # pip's own merge of files and PIP_* variables

    options, _ = create_command("install").parse_args([])
    out: list[str] = []
    if options.index_url and options.index_url.rstrip("/") != PYPI:
        out += ["--index-url", options.index_url]
    for flag, values in (
        ("--extra-index-url", options.extra_index_urls),
        ("--find-links", options.find_links),
        ("--constraint", options.constraints),
    ):
        for value in values or ():
            out += [flag, value]
    if options.cert:
        out.append(f"SSL_CERT_FILE={options.cert}")
    return out


def main() -> None:
    try:
        lines = pip_options()
    except Exception:  # no pip, or one whose internals moved: uv's own defaults
        lines = []
    print("\n".join([*lines, *ALWAYS]))


if __name__ == "__main__":
    main()
