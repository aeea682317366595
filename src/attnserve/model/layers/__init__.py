"""The building blocks of attnserve's models: linear, embedding, norm, rotary, activation."""
