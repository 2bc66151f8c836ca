#!/usr/bin/env bash
# Samples every Serve process (proxy, ingress, replica, engine core) for 60 s once the replica is up.
PYSPY=$(command -v py-spy || echo /tmp/py-spy)
mkdir -p /tmp/pyspy
for i in $(seq 1 240); do
  pgrep -f "LLMReplica" > /dev/null && break; sleep 0.5
done
sleep 15   # model load and capture; busy samples come mostly from the loaded run (idle threads are not sampled)
for name in ProxyActor LLMReplica spawn_main; do
  for pid in $(pgrep -f "$name" | head -2); do
    $PYSPY record -p $pid -d 60 -r 100 -f raw -o /tmp/pyspy/$name-$pid.txt --nonblocking > /tmp/pyspy/$name-$pid.log 2>&1 &
  done
done
wait
