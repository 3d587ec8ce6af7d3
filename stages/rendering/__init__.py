"""Rendering the serving configs: sandboxed Jinja2 templates, the escaping filters for each
format they write (YAML, JSON, protobuf text), and parsing Triton's config back."""
