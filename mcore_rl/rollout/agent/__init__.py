"""Multi-turn tool use: tools (`tools.py`), chat formats' tool-call markup (`parser.py`), the episode loop
(`loop.py`)."""
