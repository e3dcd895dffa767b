"""The Hugging Face chat-template renderer and the tool-call formats of model families."""
