"""The release spec, one module per section; `schemas/release.py` assembles them into
ReleaseSpec with the cross-section rules. A stage depends (in dvc.yaml) only on the modules
of the sections it reads (pipelines/closure.py)."""
