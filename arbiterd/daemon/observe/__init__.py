"""What the daemon tells about itself: it observes and records, and decides nothing (this
folder's ruff.toml bans the edges and the core).

    eventbus    stamps, counts, journals and fans out every event
    journal     the SQLite event history
    metrics     Prometheus figures
    vramwatch   VRAM readings, the engines' own figures, verified teardowns
    telemetry/  VRAM readers (NVML, AMD sysfs, DRM fdinfo, accounting) and the sampler
"""
