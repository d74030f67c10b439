#!/usr/bin/env bash
# Triton's perf_analyzer on a machine whose glibc is older than 2.38 (Debian 12, JetPack 6), for
# tools/bench_perf_analyzer.py: its wheel from PyPI, and glibc/libstdc++ from Debian 13 unpacked
# beside it with a private apt configuration (dpkg -x: nothing is installed system-wide). Writes
# DIR/perf_analyzer, a wrapper that runs the binary under Debian 13's loader.
#   usage: tools/fetch_perf_analyzer.sh [DIR]   (default: .perf_analyzer; needs apt-get and pip)
set -euo pipefail
dir=$(realpath -m "${1:-.perf_analyzer}")
version=2.60.0
mkdir -p "$dir"/apt/lists/partial "$dir"/apt/cache/archives/partial "$dir"/apt/etc "$dir"/root
python3 -m pip download --quiet --no-deps "perf-analyzer==$version" --platform manylinux_2_38_x86_64 \
  --only-binary=:all: --python-version 3.12 -d "$dir"
python3 -m zipfile -e "$dir/perf_analyzer-$version-py3-none-manylinux_2_38_x86_64.whl" "$dir/wheel"
chmod +x "$dir/wheel/perf_analyzer/bin/perf_analyzer"
cat > "$dir/apt/etc/trixie.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
apt_private=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$dir/apt/etc"
             -o "Dir::State::Lists=$dir/apt/lists" -o "Dir::Cache=$dir/apt/cache")
apt-get "${apt_private[@]}" update -qq
(cd "$dir" && apt-get "${apt_private[@]}" download libc6 libstdc++6 libgcc-s1 2>/dev/null)
for deb in "$dir"/*.deb; do dpkg -x "$deb" "$dir/root"; done
cat > "$dir/perf_analyzer" <<WRAPPER
#!/bin/sh
exec "$dir/root/usr/lib64/ld-linux-x86-64.so.2" \\
  --library-path "$dir/root/usr/lib/x86_64-linux-gnu" "$dir/wheel/perf_analyzer/bin/perf_analyzer" "\$@"
WRAPPER
chmod +x "$dir/perf_analyzer"
"$dir/perf_analyzer" --version 2>/dev/null | head -1 || true
echo "perf_analyzer: $dir/perf_analyzer"
