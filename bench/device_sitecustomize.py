import faulthandler
import logging
import signal

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
logging.getLogger("ray").setLevel(logging.WARNING)
faulthandler.register(signal.SIGUSR1, all_threads=True)
