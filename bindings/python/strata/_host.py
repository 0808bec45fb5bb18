"""Host probes any binding reads before it builds a runtime: the memory available now, the
free disk the NVMe tier's files may take, the file systems holding them. Nothing here knows
about models, frameworks or sessions. Read by strata._tiering (the NVMe plan's defaults, for
every binding) and named by strata.torch._host."""

import os


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def disk_free(paths):
    """Bytes the NVMe tier's files can take: the striped files grow equally, so each file
    system holds its share (its files over all of them) of the budget; 5% and 1 GiB of each
    are left to it."""
    free, files = {}, {}
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        st = os.statvfs(folder)
        dev = os.stat(folder).st_dev
        free[dev] = max(0, int(st.f_bavail * st.f_frsize * 0.95) - (1 << 30))
        files[dev] = files.get(dev, 0) + 1
    return min(free[dev] * len(paths) // files[dev] for dev in free)


def file_systems(paths):
    """The file systems (st_dev) holding the folders of `paths`, sorted: the NVMe tier's files
    on one of them share its disks."""
    return sorted({os.stat(os.path.dirname(os.path.abspath(p))).st_dev for p in paths})
