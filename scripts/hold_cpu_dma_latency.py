"""Hold the Linux PM QoS request "CPU wake-up latency <= N us" while this process lives (N = 0: no deep C-states).

    sudo python scripts/hold_cpu_dma_latency.py 0 &      # then run the benchmark; kill it to release

Deep C-states save power but a core that sleeps in one takes tens to hundreds of microseconds to wake; a Propose
round trip wakes several threads in two processes (docs/performance.md measures what that costs). Needs write
access to /dev/cpu_dma_latency (root, or a privileged container).
"""
import os
import struct
import sys
import time

if __name__ == "__main__":
    us = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", us))
    print(f"holding cpu_dma_latency = {us} us (pid {os.getpid()})", flush=True)
    while True:
        time.sleep(3600)
