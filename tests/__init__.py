"""dtfm tests: packages mirror the code (coordinator/, agent/, dtfm/).

system/ runs whole programs together.
"""
