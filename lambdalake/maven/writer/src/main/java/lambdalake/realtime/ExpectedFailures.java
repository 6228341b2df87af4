package lambdalake.realtime;

import java.util.Set;
import org.apache.logging.log4j.LogManager;
import org.apache.logging.log4j.core.Appender;
import org.apache.logging.log4j.core.Filter;
import org.apache.logging.log4j.core.LogEvent;
import org.apache.logging.log4j.core.LoggerContext;
import org.apache.logging.log4j.core.config.Configuration;
import org.apache.logging.log4j.core.filter.AbstractFilter;
import org.apache.logging.log4j.core.filter.AbstractFilterable;

/**
 * Keeps out of a job's log what Spark writes, with stack traces, about failures the job expects and
 * reports in a line of its own: a Real-time task stopped by {@link UnknownWriterSchema} (the job
 * logs "met writer schema id N" and starts the query again), each retry of it, and the tasks that
 * a failure or a stop interrupts. A Real-time task lasts its whole batch, so every such failure
 * interrupts the query's other tasks, and Spark logs each of them several times over.
 *
 * <p>What stays: every other failure with its stack trace, and the one line per query failure that
 * says a task failed its attempts. The "aborting commit" bookkeeping of a data writer is dropped
 * always: it follows a task's failure, which the executor logs with its cause.
 */
public final class ExpectedFailures extends AbstractFilter {
  private static final Set<String> INTERRUPTS =
      Set.of(
          "java.lang.InterruptedException",
          "org.apache.kafka.common.errors.InterruptException",
          "org.apache.spark.TaskKilledException");
  private static final Set<String> BOOKKEEPING =
      Set.of(
          "org.apache.spark.sql.execution.datasources.v2.DataWritingSparkTask",
          "org.apache.spark.sql.execution.datasources.v2.WriteToDataSourceV2Exec");
  private static volatile boolean installed;

  private ExpectedFailures() {
    super(Result.DENY, Result.NEUTRAL);
  }

  /** Adds the filter to every appender of this JVM's log configuration, once. */
  public static synchronized void install() {
    if (installed) {
      return;
    }
    // Spark's own log4j-core: a JVM logging elsewhere (another binding) is left as it is.
    if (LogManager.getContext(false) instanceof LoggerContext context) {
      Configuration config = context.getConfiguration();
      Filter filter = new ExpectedFailures();
      for (Appender appender : config.getAppenders().values()) {
        if (appender instanceof AbstractFilterable filterable) {
          filterable.addFilter(filter);
        }
      }
    }
    installed = true;
  }

  @Override
  public Result filter(LogEvent event) {
    return expected(event.getLoggerName(), event.getMessage().getFormattedMessage(), event.getThrown())
        ? onMatch
        : onMismatch;
  }

  /** Whether an event reports only an expected failure (see the class's comment). */
  static boolean expected(String logger, String message, Throwable thrown) {
    if (message != null && message.contains(UnknownWriterSchema.PREFIX)) {
      return true; // a lost or killed task's reason, as text
    }
    if (thrown == null) {
      return BOOKKEEPING.contains(logger);
    }
    for (Throwable t = thrown; t != null; t = t.getCause() == t ? null : t.getCause()) {
      if (t instanceof UnknownWriterSchema || INTERRUPTS.contains(t.getClass().getName())) {
        return true;
      }
    }
    return false;
  }
}
