"""Worker adapter: the only control-plane code that speaks an engine's (SGLang's) wire formats."""
