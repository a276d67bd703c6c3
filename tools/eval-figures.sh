#!/usr/bin/env bash
# Draw the evaluation figures of docs/policies.md from the data files that
# `policy-eval --data-dir DIR` writes (`make eval` runs both).
#
#   tools/eval-figures.sh DATA_DIR OUT_DIR
#
# Installs gnuplot (Debian's gnuplot-nox) when it is missing, as root or
# through sudo; it is not a build or test dependency.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: tools/eval-figures.sh DATA_DIR OUT_DIR" >&2
  exit 2
fi
data=$1
out=$2
for f in curve-ratio.dat curve-far.dat curve-survival.dat span-keep-0.25.dat span-keep-0.1.dat; do
  if [ ! -r "$data/$f" ]; then
    echo "eval-figures: $data/$f is missing; run build/tools/policy-eval --data-dir $data first" >&2
    exit 1
  fi
done

if ! command -v gnuplot >/dev/null 2>&1; then
  echo "eval-figures: installing gnuplot-nox (Debian) to draw the figures"
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "eval-figures: gnuplot is missing and this user cannot install it; run as root:" \
      "apt-get update && apt-get install -y gnuplot-nox" >&2
    exit 1
  fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq gnuplot-nox
fi

mkdir -p "$out"
# 13 policies: colours from a fixed list, dash and point types vary too, so
# lines that overlap stay tellable apart.
gnuplot <<GP
set terminal pngcairo size 1000,640 font ",11"
set datafile columnheaders
set key outside right top
set grid
set logscale x
set xrange [0.045:1.05]
set xtics (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1)
set xlabel "retention (fraction of tokens kept)"
array colours[13] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f", "#8c564b", "#d62728", "#9467bd", \
                     "#e377c2", "#bcbd22", "#17becf", "#000000", "#aec7e8", "#ff9896"]
do for [i=1:13] {
  set linetype i linecolor rgb colours[i] linewidth 2 pointtype i % 7 + 1 dashtype 1
}
do for [i=8:13] {
  set linetype i dashtype 2
}

set output "$out/eval-ratio.png"
set title "NLL ratio on the continuation (8 stories, protection scaled with retention)"
set ylabel "NLL(cont | compressed) / NLL(cont | full)"
plot for [i=2:14] "$data/curve-ratio.dat" using 1:i with linespoints linetype (i - 1) title columnhead(i)

set output "$out/eval-far.png"
set title "NLL ratio on far-copy tokens (rare words first seen in the prefix's first half)"
set ylabel "summed NLL, compressed / full"
plot for [i=2:14] "$data/curve-far.dat" using 1:i with linespoints linetype (i - 1) title columnhead(i)

set output "$out/eval-survival.png"
set title "Instruction survival: worst span's NLL ratio (4 openings, each repeated and continued)"
set ylabel "worst span's NLL ratio"
plot for [i=2:14] "$data/curve-survival.dat" using 1:i with linespoints linetype (i - 1) title columnhead(i)

reset
set terminal pngcairo size 1200,900 font ",10"
set output "$out/eval-span-keep.png"
set datafile columnheaders
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set yrange [0:1.05]
set grid ytics
set xtics rotate by -35
set key top left horizontal
set multiplot layout 2,2 title "Kept fraction of each span's unprotected entries (4 equal spans, protection scaled)"
do for [r in "0.25 0.1"] {
  set title sprintf("retention %s, fair=0", r)
  plot for [k=2:5] sprintf("$data/span-keep-%s.dat", r) using k:xtic(1) title sprintf("span %d", k - 1)
  set title sprintf("retention %s, fair=1", r)
  plot for [k=6:9] sprintf("$data/span-keep-%s.dat", r) using k:xtic(1) title sprintf("span %d", k - 5)
}
unset multiplot
GP
echo "eval-figures: wrote $out/eval-ratio.png, eval-far.png, eval-survival.png, eval-span-keep.png"
