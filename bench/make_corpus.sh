#!/usr/bin/env bash
# Build .corpus/corpus.tar.xz, the demo pair's training corpus, from this machine's Python:
# corpus/stdlib = the running interpreter's standard library (.py files, site-packages left out),
# corpus/<package> = the .py files of each installed package below. One corpus root per directory,
# so the train / held-out split of the stdlib files equals the split of the stdlib alone.
#   bench/make_corpus.sh [PYTHON]      (default: .venv/bin/python)
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
PACKAGES="torch ray numpy matplotlib networkx pip setuptools huggingface_hub pydantic hypothesis _pytest
          rich jinja2 click anyio packaging fsspec grpc triton"
STAGE=$(mktemp -d)
mkdir -p "$STAGE/corpus/stdlib" .corpus
STDLIB=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
SITE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
(cd "$STDLIB" && find . -name '*.py' -not -path '*/site-packages/*' -print0 | tar --null -cf - -T -) \
    | tar -xf - -C "$STAGE/corpus/stdlib"
for package in $PACKAGES; do
    (cd "$SITE" && find "$package" -name '*.py' -print0 | tar --null -cf - -T -) | tar -xf - -C "$STAGE/corpus"
done
tar -cJf .corpus/corpus.tar.xz -C "$STAGE" corpus
rm -rf "$STAGE"
ls -la .corpus/corpus.tar.xz
