"""Sample prompts that `llmtrace run NAME` traces by name: one UTF-8 text file per prompt, shipped as package data
(llmtrace.sample_prompts) and read with importlib.resources, so a wheel install has them too."""
