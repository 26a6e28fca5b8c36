"""A module whose __init__ changes the working folder (to /), as some user code does."""
import os

from examples.audit_models import Plain


class ChangesFolder(Plain):
    def __init__(self, *args, **kwargs):
        os.chdir("/")
        super().__init__(*args, **kwargs)
