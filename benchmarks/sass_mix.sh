#!/bin/bash
# Opcode histogram of packed_partial's SASS (KIVI G=128, d=128, GQ=4), for instruction-count work.
set -e
nvcc -arch=sm_90 -cubin -std=c++17 --use_fast_math -DD=128 -DG=${G:-128} -DGV=${G:-128} -DGQ=4 -DHAS_NORM=0 -DBLOCKS_PER_SM=${BPS:-4} -DQT=__half -DSPLIT_UNIT=128 \
  -I kernels_cupy -o /tmp/k.cubin kvcalib/formats/int2/int2_decode.cu
cuobjdump -sass -fun packed_partial /tmp/k.cubin > /tmp/k.sass
grep -cE '^\s+/\*[0-9a-f]{4}\*/' /tmp/k.sass | sed 's/^/instructions: /'
grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+' /tmp/k.sass | awk '{print $NF}' | sort | uniq -c | sort -rn | head -30
