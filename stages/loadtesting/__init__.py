"""The load test (the loadtest stage's subsystem): load generation against a V2 or OpenAI
endpoint, its phases (grid, ramp, streaming, soak, batching on/off), the measurements
against one running server, SLO verdicts and the offline plots. It starts bundles with
its harnesses (server.py: MLServer through the shipped launcher; triton_server.py: Triton)
and never ships in one."""
