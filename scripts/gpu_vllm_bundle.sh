#!/usr/bin/env bash
# Build the vLLM CUDA bundle for the device machine (run here, where PyPI is reachable; issue #22).
#
#   scripts/gpu_vllm_bundle.sh [OUT=.whl]      # then carry OUT/p1, OUT/p2, OUT/p3 in three `run` calls
#
# vLLM 0.26.0 is the last release whose wheel pins torch==2.11.0 (0.27.0 and later pin 2.13.0) and it
# links libcudart.so.13: the device's torch 2.11.0+cu130. Its wheel is 290 MiB (698 MiB unpacked);
# left out: FlashAttention-2 (_vllm_fa2_C, 291 MiB unpacked; Hopper runs FlashAttention-3), the Rust
# front end (vllm-rs, 41 MiB) and DeepGEMM's builds for other Pythons. The rest, xz-compressed, is
# 112 MiB: two parts of <= 57 MiB. The dependencies the device image lacks (its package list is in
# /work/.library/device/KINDS.md) are resolved by pip for cp312 manylinux and packed the same way
# (23 MiB). scripts/gpu_vllm_setup.sh joins and unpacks them there.
set -euo pipefail
OUT=$(realpath -m "${1:-.whl}")
TMP=$(mktemp -d)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
mkdir -p "$OUT"/p1 "$OUT"/p2 "$OUT"/p3
pip download --no-deps "${PLAT[@]}" -d "$TMP/whl" vllm==0.26.0
mkdir "$TMP/vllm" && (cd "$TMP/vllm" && unzip -q "$TMP"/whl/vllm-0.26.0-*.whl)
rm -f "$TMP"/vllm/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$TMP"/vllm/vllm/vllm-rs \
      "$TMP"/vllm/vllm/third_party/deep_gemm/_C.cpython-31[01345]-*.so
(cd "$TMP/vllm" && tar -cf - vllm vllm-0.26.0.dist-info | xz -T0 -6 > "$TMP/vllm-slim.tar.xz")
split -b 57M -d -a 1 "$TMP/vllm-slim.tar.xz" "$TMP/vllm-slim.tar.xz.part"
mv "$TMP/vllm-slim.tar.xz.part0" "$OUT/p1/"; mv "$TMP/vllm-slim.tar.xz.part1" "$OUT/p2/"
# vLLM 0.26.0's requirements that the image lacks (transitive ones resolved by pip), then the ones
# pip must not resolve (they require torch), then what a trace of `import vllm.entrypoints.openai.api_server`
# showed imported without being declared. vLLM pins apache-tvm-ffi==0.1.10, but xgrammar 0.2.9 (the newest
# its range allows) needs >= 0.1.11 and fails at import with 0.1.10 (load_lib_module() got an unexpected
# keyword argument 'extra_lib_paths'; seen on the device): 0.1.11 (FlashInfer, the pin's reason, is not installed)
pip download "${PLAT[@]}" -d "$TMP/deps" 'fastapi[standard]<0.137.0,>=0.133.0' 'starlette>=1.0.1' 'openai>=2.0.0' \
  'pydantic>=2.12.0' 'prometheus-fastapi-instrumentator>=8.0.0' lm-format-enforcer==0.11.3 'llguidance<1.8.0,>=1.7.0' \
  outlines_core==0.2.14 lark==1.2.2 partial-json-parser 'jsonschema>=4.23.0' 'pyzmq>=25.0.0' msgspec \
  'mistral_common>=1.11.5' depyf==0.20.0 watchfiles python-json-logger pybase64 cbor2 ijson setproctitle \
  'openai-harmony>=0.0.3' 'anthropic>=0.71.0' 'model-hosting-container-standards<1.0.0,>=0.1.14' mcp blake3 cachetools
pip download --no-deps "${PLAT[@]}" -d "$TMP/deps" compressed-tensors==0.17.0 'xgrammar<1.0.0,>=0.2.1' \
  apache-tvm-ffi==0.1.11 loguru truststore
# the image has these already (KINDS.md): installing them again would shadow its builds
(cd "$TMP/deps" && for f in *.whl; do n=$(echo "$f" | cut -d- -f1 | tr 'A-Z_' 'a-z-'); case " annotated-doc anyio attrs \
  certifi charset-normalizer click h11 httpcore httpx idna jinja2 markdown-it-py markupsafe mdurl numpy packaging pillow \
  prometheus-client pygments pyyaml regex requests rich setuptools shellingham tiktoken typer urllib3 uvloop cffi \
  pycparser cryptography sentry-sdk fastapi-cloud-cli fastar rignore supervisor " in *" $n "*) rm "$f";; esac; done)
pip install -q --no-deps --no-compile --target "$TMP/site" "${PLAT[@]}" "$TMP"/deps/*.whl
rm -rf "$TMP/site/bin"
(cd "$TMP/site" && tar -cf - . | xz -T0 -6 > "$OUT/p3/deps-site.tar.xz")
rm -rf "$TMP"
ls -la "$OUT"/p1 "$OUT"/p2 "$OUT"/p3
