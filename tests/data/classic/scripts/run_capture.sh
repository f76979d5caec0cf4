#!/usr/bin/env bash
# Usage: run_capture.sh RUNNAME [HOST]
# Runs target+initiator inside a private network namespace (so the capture
# holds only this pair's traffic) while tcpdump records loopback.
set -u
RUN=$1; HOST=${2:-127.0.0.1}
D=/work/classic-capture
PY=$D/venv/bin/python
OUT=$D/$RUN; mkdir -p $OUT; rm -f $OUT/info.json $OUT/done
exec unshare --net bash -c "
ip link set lo up
tcpdump -i lo -B 262144 -U -s 0 -w $D/$RUN.pcap >$OUT/tcpdump.log 2>&1 &
TD=\$!
sleep 1
$PY $D/scripts/target.py $OUT/info.json $OUT/done $HOST >$OUT/target.out 2>$OUT/target.err &
TG=\$!
$PY $D/scripts/initiator.py $OUT/info.json $OUT/done $HOST >$OUT/initiator.out 2>$OUT/initiator.err
echo initiator_exit=\$? >>$OUT/exit_codes
wait \$TG; echo target_exit=\$? >>$OUT/exit_codes
sleep 1
kill -INT \$TD; wait \$TD
"
