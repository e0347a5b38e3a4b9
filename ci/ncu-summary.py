"""Sums an Nsight Compute raw CSV (`ncu --csv --page raw`) per kernel name: launches, total and
mean time, DRAM bytes and the bandwidth they make, registers, occupancy. Used by
ci/device-check.sh on the device; prints a table."""
import csv
import sys
from collections import OrderedDict


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path):
    lines = [line for line in open(path) if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows:
        print("ncu: no kernels in", path)
        return
    units = rows[0]
    rows = rows[1:]  # the second line holds the units
    by_name = OrderedDict()
    for row in rows:
        name = row.get("Kernel Name", "?").split("(")[0]
        entry = by_name.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0, 0.0])
        entry[0] += 1
        time = number(row.get("gpu__time_duration.sum", "0"))
        if units.get("gpu__time_duration.sum") == "usecond":
            time *= 1e3
        elif units.get("gpu__time_duration.sum") == "msecond":
            time *= 1e6
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
        read = number(row.get("dram__bytes_read.sum", "0")) * scale.get(units.get("dram__bytes_read.sum"), 1)
        write = number(row.get("dram__bytes_write.sum", "0")) * scale.get(units.get("dram__bytes_write.sum"), 1)
        entry[1] += time
        entry[2] += read + write
        entry[3] = number(row.get("launch__registers_per_thread", "0"))
        entry[4] += number(row.get("sm__warps_active.avg.pct_of_peak_sustained_active", "0"))
    total = sum(e[1] for e in by_name.values())
    print(f"{'kernel':28} {'launches':>8} {'total us':>10} {'share':>6} {'mean us':>9} {'GB/s':>8} {'regs':>5} {'occ%':>5}")
    for name, (count, time, bytes_, regs, occupancy, _) in by_name.items():
        print(f"{name[:28]:28} {count:8d} {time / 1e3:10.1f} {time / total:6.1%} {time / count / 1e3:9.2f} "
              f"{bytes_ / time if time else 0:8.0f} {regs:5.0f} {occupancy / count:5.1f}")
    print(f"{'all':28} {sum(e[0] for e in by_name.values()):8d} {total / 1e3:10.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
