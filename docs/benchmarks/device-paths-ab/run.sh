#!/bin/bash
source /work/main/.venv/bin/activate
OPS=all_reduce,broadcast,all_gather,all_gather_into_tensor,all_to_all_single,all_to_all,reduce_scatter,reduce_scatter_tensor,gather,scatter
for i in 1 2 3; do for v in old new; do
  P=/tmp/old; [ $v = new ] && P=/work/main
  ( cd $P && PYTHONPATH=$P timeout 900 python -m hpcddp bench comm --np 2 --ops $OPS --sizes 8,1K,64K,1M \
      --impls mpi4py,hpcddp,direct --rounds 9 --json /work/ab-device/comm-$v-$i.json > /work/ab-device/log-$v-$i.txt 2>&1 )
  echo "$v $i rc=$? $(date +%T)"
done; done
