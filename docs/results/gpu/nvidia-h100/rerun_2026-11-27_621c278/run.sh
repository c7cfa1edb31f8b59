#!/bin/bash
# One device call: machine facts, the gpu-marked tests, bench --suite gpu without memory=auto
# (the compile rows were cut last time), then the default job on the GPU.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/avsite .gpu/av-*.whl || exit 3
export PYTHONPATH=$PWD:$PWD/.gpu/site:/tmp/avsite PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{ date -u; nvidia-smi; nproc; free -g | head -2;
  python3 -c "import sys, torch, torchvision, timm, av, hydra, omegaconf, pytorchvideo.data, videotrain; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'av', av.__version__, 'hydra', hydra.__version__, 'omegaconf', omegaconf.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"; } > $OUT/machine.txt 2>&1
tail -2 $OUT/machine.txt
grep -q " torch 2\." $OUT/machine.txt || { echo "import check failed"; cat $OUT/machine.txt; exit 4; }
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 4"
echo "pytest $N"
timeout 200 python3 -m pytest -m gpu -rA -s $N --durations=8 -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1
echo "pytest rc=$? after $(el) s"; tail -3 $OUT/gpu_tests.log
B=$(( 470 - $(el) )); echo "bench budget $B s"
python3 -m videotrain.bench --suite gpu --only 'e2e,sbp-*,frame_dropout-*,checkpoint-*,*torch.compile*' \
  --out $OUT --time-budget $B --timeout 170 2>&1 | grep -v "Warning\|re.split" | tee $OUT/bench.log
echo "bench done after $(el) s"
L=$(( 570 - $(el) ))
if [ $L -ge 45 ]; then
  mkdir -p /tmp/dj; S=$(date +%s.%N)
  timeout $L python3 -m videotrain trainer.progress=false logger.wandb.mode=disabled hydra.run.dir=/tmp/dj/run > /tmp/dj/stdout.log 2>&1
  echo "default job rc=$? wall $(python3 -c "import time; print(round(time.time()-$S,1))") s (limit $L s)" | tee -a /tmp/dj/stdout.log
  tail -4 /tmp/dj/stdout.log; tar czf $OUT/default_job.tgz -C /tmp/dj . 2>/dev/null
fi
echo "done after $(el) s"
